"""Replicates and the yardstick: which runs a law may combine, and how noisy each rung's measurement is.

- The yardstick (`check_yardstick`): a law fits final eval losses scored on one eval set. Every run
  records its eval set's fingerprint in status.json (`eval_set.fingerprint`, engines/evalset.py); runs
  whose fingerprints differ, or that lack one beside runs that have one, are refused with one line
  naming the runs and both fingerprints (YardstickError, a ValueError: exit 2 from the CLI).
- Families (`group`): runs that differ only in their seed (the same `spec.replace(seed=0, name="x").id`)
  are one rung measured several times (ladder.experiment.replicate makes them). A family is one point
  of the law, at the mean of its members' final eval losses.
- Measurement noise (`noise`): the seed spread, pooled over the families that have replicates, is the
  variance of one run's log final loss about its family's mean (within-family variance, its degrees of
  freedom sum(n_f - 1)); a family's mean then carries seed_var / n_f, plus the eval set's own sampling
  variance (eval_loss_se / eval_loss)^2 of its members (the same windows score every run, so that part
  does not shrink with n_f). A ladder without replicates measures no seed spread: `warnings` says so.

Everything is in log loss (relative), the space the laws fit in. Shape legend: F families, R runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from core.errors import InputError
from core.rundir import RunDir
from core.spec import Spec

__all__ = ["YardstickError", "Family", "Noise", "eval_fingerprint", "check_yardstick", "family_key", "group", "noise"]


class YardstickError(InputError):
    """Runs scored on different eval sets cannot share a law."""


class _Run(Protocol):
    spec: Spec
    run_dir: Path

    @property
    def final_loss(self) -> float: ...

    @property
    def final_se(self) -> float | None: ...


def eval_fingerprint(run_dir: str | Path | None) -> str | None:
    """The run's eval set fingerprint from its status.json (None: the run records none)."""
    if run_dir is None:
        return None
    es = RunDir(run_dir).read_status().get("eval_set")
    fp = es.get("fingerprint") if isinstance(es, dict) else None
    return str(fp) if fp else None


def check_yardstick(runs: Sequence[Any], fingerprints: dict[str, str | None] | None = None) -> str | None:
    """The one eval fingerprint every run shares (None: none records one); YardstickError when they
    differ. `fingerprints` (name -> fingerprint) skips reading status.json."""
    fps = fingerprints if fingerprints is not None else {r.spec.name: eval_fingerprint(r.run_dir) for r in runs}
    by: dict[str | None, list[str]] = {}
    for name, fp in fps.items():
        by.setdefault(fp, []).append(name)
    if len(by) <= 1:
        return next(iter(by), None)
    (fa, na), (fb, nb) = sorted(by.items(), key=lambda kv: -len(kv[1]))[:2]

    def show(fp, names):
        return f"{', '.join(sorted(names))} ({fp if fp else 'no eval_set fingerprint in status.json'})"

    more = f" and {len(by) - 2} more eval set(s)" if len(by) > 2 else ""
    raise YardstickError(f"runs scored on different eval sets cannot share a law: {show(fa, na)} against "
                         f"{show(fb, nb)}{more}; rescore or rerun them on one eval set, or fit them apart")


def family_key(spec: Spec) -> str:
    """Runs with the same key differ only in their seed (and name)."""
    return spec.replace(seed=0, name="x").id


@dataclass
class Family:
    """One rung measured by one or more seeds; `runs` sorted by seed, the first is the family's face."""

    key: str
    runs: list[Any]

    @property
    def spec(self) -> Spec:
        return self.runs[0].spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def names(self) -> list[str]:
        return [r.spec.name for r in self.runs]

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def finals(self) -> np.ndarray:
        return np.array([r.final_loss for r in self.runs], dtype=np.float64)

    @property
    def final_loss(self) -> float:
        """The mean final eval loss of the family's runs."""
        return float(np.mean(self.finals))

    @property
    def eval_rel_se(self) -> float | None:
        """The members' eval standard error relative to their loss (root mean square), None if none reports one."""
        se = [r.final_se / r.final_loss for r in self.runs if getattr(r, "final_se", None) is not None]
        se = [s for s in se if math.isfinite(s)]
        return float(math.sqrt(np.mean(np.square(se)))) if se else None


def group(runs: Sequence[Any]) -> list[Family]:
    """Runs grouped into families (runs that differ only in their seed), in the order of first appearance."""
    fams: dict[str, Family] = {}
    for r in runs:
        fams.setdefault(family_key(r.spec), Family(family_key(r.spec), [])).runs.append(r)
    for f in fams.values():
        f.runs.sort(key=lambda r: (r.spec.seed, r.spec.name))
    return list(fams.values())


@dataclass
class Noise:
    """The ladder's measurement noise, in log loss."""

    seed_var: float | None  # one run's variance about its family mean (None: no replicates)
    seed_dof: int  # its degrees of freedom, sum over families of (n_f - 1)
    eval_var: float  # the eval set's own sampling variance (mean over runs reporting a standard error)
    family_var: dict[str, float] = field(default_factory=dict)  # a family mean's variance, by family name
    warnings: list[str] = field(default_factory=list)

    @property
    def run_var(self) -> float:
        """One run's measurement variance: what a single-seed run (the hero) carries."""
        return (self.seed_var or 0.0) + self.eval_var

    def to_dict(self) -> dict[str, Any]:
        return {"seed_sd": None if self.seed_var is None else math.sqrt(self.seed_var), "seed_dof": self.seed_dof,
                "eval_sd": math.sqrt(self.eval_var), "run_sd": math.sqrt(self.run_var),
                "family_sd": {k: math.sqrt(v) for k, v in self.family_var.items()},
                "method": "seed spread: within-family variance of log final eval loss, pooled over the families with "
                          "replicates; a family mean carries it / n, plus the eval set's sampling variance "
                          "(eval_loss_se / eval_loss)^2", "warnings": list(self.warnings)}


def noise(families: Sequence[Family]) -> Noise:
    ss, dof = 0.0, 0
    for f in families:
        if f.n > 1:
            y = np.log(f.finals)
            ss += float(np.sum((y - y.mean()) ** 2))
            dof += f.n - 1
    ses = [f.eval_rel_se for f in families if f.eval_rel_se is not None]
    eval_var = float(np.mean(np.square(ses))) if ses else 0.0
    warnings = []
    seed_var = ss / dof if dof else None
    if seed_var is None:
        warnings.append("no rung has a replicate seed: the ladder's seed-to-seed noise is not measured, and the "
                        "interval carries only the eval set's standard error for it")
    elif dof < 3:
        warnings.append(f"the seed spread rests on {dof} degree(s) of freedom (replicates of "
                        f"{', '.join(f.name for f in families if f.n > 1)}): it is itself uncertain")
    if not ses:
        warnings.append("no run reports its final eval loss's standard error (eval_loss_se)")
    fam_var = {f.name: (seed_var or 0.0) / f.n + (f.eval_rel_se or 0.0) ** 2 for f in families}
    return Noise(seed_var, dof, eval_var, fam_var, warnings)
