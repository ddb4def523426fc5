"""Metric-name maps: another training stack's metric names onto this project's.

    names = load_metric_names("olmo-core")          # a preset, or a path to a YAML map
    frame = names.apply(wide)                        # stack columns -> step, loss, grad_norm, ...

A map names, for each of this project's metrics, the stack's metric names that carry it:

    loss: "train/CE loss"
    grad_norm: "optim/total grad norm"
    eval_loss: {names: ["eval/lm/*/CE loss"], reduce: mean}
    lr: {names: ["optim/LR (group 0)"], reduce: first}

A name may be a glob (`fnmatch`: `*`, `?`, `[...]`); where several columns match one metric, `reduce`
decides: `mean` (default: per-layer router entropy, several eval sets) or `first` (the first
matching column in sorted order with a value, e.g. the first optimizer group's LR). The project's
own metrics (`step`, `tokens`, `loss`, `eval_loss`, `grad_norm`, `lr`, `drop_frac_send`,
`drop_frac_recv`, `router_entropy`, `tokens_per_s`, `time`) are the keys; a YAML map may start from a
preset with `preset: olmo-core` and override some of its keys. Columns the map does not name are
left as they are (so a CSV's usual aliases still apply).

The presets come from the stacks' own source; each name carries the file and line it is logged
from (OLMo-core v3.0.0 = `ai2-olmo-core` 3.0.0 on PyPI, Levanter at `levanter` 1.2.dev1644 on PyPI,
the version Marin trains with, torchtitan 0.3.0). Paths are the repositories' own
(allenai/OLMo-core, stanford-crfm/levanter, pytorch/torchtitan).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import pandas as pd
import yaml

from core.errors import InputError
from core.safeload import InputLimitError, load_file

__all__ = ["ALIASES", "CANONICAL", "PRESETS", "MetricNames", "MetricNamesError", "load_metric_names", "matches", "mlflow_legal"]

# The one alias table: this project's metric -> the names other tools commonly export it under (a CSV's
# columns are compared lower-case, stripped); a stack's own names (PRESETS below) come first where given.
ALIASES: dict[str, tuple[str, ...]] = {
    "step": ("step", "_step", "global_step", "iteration", "iter", "trainer/global_step", "steps"),
    "tokens": ("tokens", "tokens_seen", "num_tokens", "train/tokens", "consumed_tokens"),
    "loss": ("loss", "train_loss", "train/loss", "loss/train", "train/ce_loss", "ce_loss", "lm_loss"),
    "grad_norm": ("grad_norm", "gradnorm", "grad/norm", "train/grad_norm", "optim/total_grad_norm", "total_grad_norm"),
    "lr": ("lr", "learning_rate", "train/lr", "optim/lr"),
    "eval_loss": ("eval_loss", "eval/loss", "val_loss", "validation_loss"),
    "tokens_per_s": ("tokens_per_s", "tokens_per_sec", "throughput/tokens_per_s", "tok/s"),
    "router_entropy": ("router_entropy",),
    "drop_frac_send": ("drop_frac_send",),
    "drop_frac_recv": ("drop_frac_recv",),
    "time": ("time", "timestamp", "_timestamp", "unix_time"),
    "z_loss": ("z_loss",),
}
CANONICAL = tuple(ALIASES)

Reduce = Literal["mean", "first"]


class MetricNamesError(InputError):
    """A metric-name map that cannot be used; the message names the file or preset and the key."""


# MLflow refuses metric names outside [/\w.\- :] (mlflow/utils/validation.py
# validate_param_and_metric_name), so a stack's "optim/LR (group 0)" or torchtitan's "throughput(tps)"
# reaches an MLflow run only with its other characters replaced; "_" is what a name matches there.
_MLFLOW_ILLEGAL = re.compile(r"[^\w/.\- :*?]")


def mlflow_legal(name: str) -> str:
    """`name` (a glob too) with each character MLflow refuses in a metric name replaced by "_"."""
    return _MLFLOW_ILLEGAL.sub("_", name)


def matches(key: str, pattern: str) -> bool:
    """`key` matches `pattern` as given, or as MLflow would have to store it."""
    return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, mlflow_legal(pattern))


@dataclass(frozen=True)
class Entry:
    names: tuple[str, ...]
    reduce: Reduce = "mean"


@dataclass(frozen=True)
class MetricNames:
    """canonical metric -> the stack's names (globs allowed) and how several matches combine."""

    label: str
    entries: Mapping[str, Entry] = field(default_factory=dict)
    # the step number the stack logs for its first optimizer step (this project's is 0): frames keep
    # the stack's numbers (flags name the steps its own dashboard shows) and carry this in
    # df.attrs["first_step"], so a spec's step n is the stack's n + first_step
    first_step: int = 0

    def wanted(self, available: list[str]) -> list[str]:
        """The stack's metric keys, among `available`, that this map reads."""
        out = []
        for e in self.entries.values():
            for pat in e.names:
                out += [k for k in available if matches(k, pat) and k not in out]
        return out

    def apply(self, df: pd.DataFrame) -> pd.DataFrame:
        """A copy of `df` with each mapped metric as its canonical column; the stack's columns it was
        made from are dropped, other columns are kept. A canonical column already in `df` is kept
        when the map finds nothing for it."""
        df = df.copy()
        cols = [str(c) for c in df.columns]
        made: dict[str, pd.Series] = {}
        used: set[str] = set()
        for canon, e in self.entries.items():
            hits = []
            for pat in e.names:
                hits += [c for c in cols if matches(c, pat) and c not in hits]
            if not hits:
                continue
            used.update(hits)
            block = df[hits].apply(pd.to_numeric, errors="coerce")
            if len(hits) == 1:
                made[canon] = block.iloc[:, 0]
            elif e.reduce == "first":
                made[canon] = block[sorted(hits)].bfill(axis=1).iloc[:, 0]
            else:
                with np.errstate(all="ignore"):
                    made[canon] = block.mean(axis=1, skipna=True)
        df = df.drop(columns=[c for c in used if c not in made])
        for canon, s in made.items():
            df[canon] = s.to_numpy()
        return df


def _entries(raw: Any, origin: str) -> dict[str, Entry]:
    if not isinstance(raw, dict):
        raise MetricNamesError(f"{origin}: a metric-name map is a mapping of metric -> name(s)")
    out: dict[str, Entry] = {}
    for canon, v in raw.items():
        if canon not in CANONICAL:
            raise MetricNamesError(f"{origin}: unknown metric {canon!r} (known: {', '.join(CANONICAL)})")
        reduce: Any = "mean"
        if isinstance(v, dict):
            extra = set(v) - {"names", "reduce"}
            if extra:
                raise MetricNamesError(f"{origin}: {canon}: unknown key(s) {sorted(extra)} (use names, reduce)")
            reduce = v.get("reduce", "mean")
            v = v.get("names")
        names = [v] if isinstance(v, str) else v
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise MetricNamesError(f"{origin}: {canon}: give a metric name or a list of names")
        if reduce not in ("mean", "first"):
            raise MetricNamesError(f"{origin}: {canon}: reduce must be mean or first (got {reduce!r})")
        out[canon] = Entry(tuple(names), reduce)
    return out


# ---- presets: every name with the file and line that logs it -----------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "olmo-core": {
        # src/olmo_core/train/common.py:11  TRAIN_CE_LOSS_METRIC = "train/CE loss"
        "loss": "train/CE loss",
        # src/olmo_core/train/common.py:14  OPTIM_GRAD_NORM_METRIC = "optim/total grad norm"
        # (recorded at src/olmo_core/train/train_module/transformer/train_module.py:567,
        #  "total grad norm" under namespace "optim")
        "grad_norm": "optim/total grad norm",
        # src/olmo_core/train/train_module/transformer/train_module.py:576
        #  f"LR (group {group_idx})" under namespace "optim"
        "lr": {"names": ["optim/LR (group 0)", "optim/LR (group *)"], "reduce": "first"},
        # src/olmo_core/train/trainer.py:853 and src/olmo_core/train/callbacks/speed_monitor.py:235-236
        "tokens": "throughput/total tokens",
        # src/olmo_core/train/callbacks/speed_monitor.py:231  "throughput/device/TPS" (per device)
        # src/olmo_core/train/callbacks/evaluator_callback.py:177  f"{prefix}/{evaluator.name}/{name}",
        #  prefix "eval", evaluator "lm" (evaluator_callback.py:287), name f"{label}/CE loss"
        #  (src/olmo_core/eval/lm_evaluator.py:120): one per eval set, averaged here
        "eval_loss": {"names": ["eval/lm/*/CE loss"], "reduce": "mean"},
        # src/olmo_core/nn/moe/v2/ep_no_sync_rowwise_helpers.py:45  "token drop rate", summed over
        #  blocks (src/olmo_core/nn/transformer/model.py:1291) and recorded under namespace "train"
        #  (train_module.py:509-514). OLMo-core counts one drop rate; it stands for send + recv here.
        "drop_frac_send": "train/token drop rate",
        # src/olmo_core/train/common.py:13  TRAIN_Z_LOSS_METRIC = "train/Z loss"
        "z_loss": "train/Z loss",
    },
    "levanter": {
        # src/levanter/callbacks/_metrics.py:73  {"train/loss": step.loss, "global_step": step.step}
        "loss": "train/loss",
        # src/levanter/callbacks/watch.py:96 ("grad" prefix) + src/levanter/analysis/tree_stats.py:97
        #  f"{prefix}/norm/total": the global norm of the gradients, logged by the watch callback
        "grad_norm": "grad/norm/total",
        # src/levanter/callbacks/_metrics.py:76 (prefix "optim") + src/levanter/tracker/helpers.py:35
        #  (the optax hyperparameter "learning_rate")
        "lr": "optim/learning_rate",
        # src/levanter/callbacks/_metrics.py:127  dict_to_log["total_tokens"], wrapped with the
        #  "throughput" prefix (_metrics.py:86, applied at :146)
        "tokens": "throughput/total_tokens",
        # src/levanter/callbacks/_metrics.py:135  "tokens_per_second" under "throughput"
        "tokens_per_s": "throughput/tokens_per_second",
        # src/levanter/eval.py:238  _join_prefix(prefix, "loss"), prefix "eval" (eval.py:174)
        "eval_loss": "eval/loss",
        # src/levanter/models/mixtral.py:552  f"moe/layer{i}/routing_entropy": the entropy of the
        #  layer's expert load (not per token), averaged over layers here
        "router_entropy": {"names": ["moe/layer*/routing_entropy"], "reduce": "mean"},
    },
    "torchtitan": {
        # torchtitan/components/metrics.py:498  "loss_metrics/global_avg_loss"
        "loss": "loss_metrics/global_avg_loss",
        # torchtitan/components/metrics.py:500  "grad_norm"
        "grad_norm": "grad_norm",
        # torchtitan/components/metrics.py:501  "throughput(tps)" (per device)
        "tokens_per_s": "throughput(tps)",
        # torchtitan/trainer.py:1001  "n_tokens_seen"
        "tokens": "n_tokens_seen",
        # torchtitan/components/optimizer/lr_scheduler.py:218  f"lr/{opt_name}" or f"lr/{opt_name}/{i}"
        "lr": {"names": ["lr/*", "lr"], "reduce": "first"},
        # torchtitan/components/metrics.py:552  "validation_metrics/loss"
        "eval_loss": "validation_metrics/loss",
    },
}
PRESETS["marin"] = PRESETS["levanter"]  # Marin trains with Levanter and logs its names

# The step each stack logs for its first optimizer step:
# - OLMo-core: src/olmo_core/train/trainer.py:226 `global_step: int = 0`, incremented before each
#   batch (trainer.py:1479 `self.global_step += 1`), and metrics are recorded at global_step: 1.
# - Levanter: src/levanter/callbacks/_core.py:37 `step = property(lambda self: int(self.state.step) - 1)`,
#   "the step that was just completed", 0-indexed: 0.
# - torchtitan (v0.2.2): torchtitan/train.py:294 `self.step = 0`, :672 `self.step += 1` before the
#   step, logged at self.step: 1.
FIRST_STEP = {"olmo-core": 1, "levanter": 0, "marin": 0, "torchtitan": 1}


def load_metric_names(arg: str | Path | None) -> MetricNames | None:
    """A preset name (olmo-core, levanter, marin, torchtitan) or a YAML file; None -> None."""
    if arg is None:
        return None
    key = str(arg).strip().lower()
    if key in PRESETS:
        return MetricNames(key, _entries(PRESETS[key], f"preset {key}"), FIRST_STEP.get(key, 0))
    p = Path(arg)
    if not p.is_file():
        raise MetricNamesError(
            f"--metric-names {arg}: not a preset ({', '.join(sorted(PRESETS))}) and no such YAML file"
        )
    try:
        raw = load_file(p, "yaml") or {}
    except InputLimitError as e:
        raise MetricNamesError(str(e)) from None
    except yaml.YAMLError as e:
        raise MetricNamesError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise MetricNamesError(f"{p}: a metric-name map is a mapping of metric -> name(s)")
    base: dict[str, Entry] = {}
    preset = raw.pop("preset", None)
    first = FIRST_STEP.get(str(preset).lower(), 0) if preset is not None else 0
    if preset is not None:
        if str(preset).lower() not in PRESETS:
            raise MetricNamesError(f"{p}: preset {preset!r} is not one of {', '.join(sorted(PRESETS))}")
        base = _entries(PRESETS[str(preset).lower()], f"preset {preset}")
    if "first_step" in raw:
        first = raw.pop("first_step")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise MetricNamesError(f"{p}: first_step must be a whole number >= 0 (got {first!r})")
    return MetricNames(str(p), {**base, **_entries(raw, str(p))}, first)
