"""The `warnings` every fit and forecast carries: plain sentences naming what a reader must know
before acting on the numbers.

- a parameter at or near a bound of its search range (the optimum may lie beyond it);
- no more points than parameters (the fit interpolates; its intervals mean nothing);
- fewer than three sizes or rungs (a power law through two points is not tested by them);
- rungs that repeated data (epochs > 1) or whose train and eval losses part (memorisation);
- a bootstrap whose refits disagree wildly (a parameter's interval spans a factor of ten or more,
  or many refits fail).

Each helper returns a list of sentences (empty when nothing is wrong), so callers concatenate them.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

NEAR_BOUND_REL = 1e-3  # within this share of a bound's range (or of its value) counts as "on the bound"
BOOT_SPREAD_FACTOR = 10.0  # a positive parameter whose interval spans this factor disagrees wildly
BOOT_FAILED_SHARE = 0.2  # more failed refits than this share is a warning too
GAP_REL = 0.05  # eval loss this much above the train loss at the end: memorisation
MIN_SIZES = 3

__all__ = [
    "at_bounds",
    "too_few_points",
    "too_few_sizes",
    "bootstrap_disagreement",
    "repeated_data",
    "memorisation",
]


def at_bounds(values: Mapping[str, float], bounds: Mapping[str, tuple[float | None, float | None]],
              rel: float = NEAR_BOUND_REL) -> list[str]:
    """Names of parameters sitting at (within `rel` of the range of) a bound."""
    out = []
    for name, v in values.items():
        lo, hi = bounds.get(name, (None, None))
        if not math.isfinite(v):
            continue
        width = (hi - lo) if lo is not None and hi is not None else max(abs(v), 1.0)
        tol = rel * max(width, 1e-12)
        if lo is not None and v - lo <= tol:
            out.append(f"{name} = {v:.4g} is at its lower bound {lo:.4g}: the optimum may lie beyond it")
        elif hi is not None and hi - v <= tol:
            out.append(f"{name} = {v:.4g} is at its upper bound {hi:.4g}: the optimum may lie beyond it")
    return out


def too_few_points(n_points: int, n_params: int, what: str = "the fit") -> list[str]:
    if n_points <= n_params:
        return [f"{n_points} points for {n_params} parameters: {what} interpolates them and its intervals mean nothing"]
    return []


def too_few_sizes(n_sizes: int, what: str = "sizes") -> list[str]:
    if n_sizes < MIN_SIZES:
        return [f"only {n_sizes} {what}: a scaling law needs at least {MIN_SIZES} to be tested by its own data"]
    return []


def bootstrap_disagreement(ci: Mapping[str, Sequence[float]], n_ok: int, n_failed: int,
                           positive: Iterable[str] = ()) -> list[str]:
    out = []
    total = n_ok + n_failed
    if total and n_failed > BOOT_FAILED_SHARE * total:
        out.append(f"{n_failed} of {total} bootstrap refits failed: the fit is fragile to which points it sees")
    for name in positive:
        lo, hi = ci.get(name, (math.nan, math.nan))
        if math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi / lo >= BOOT_SPREAD_FACTOR:
            out.append(f"bootstrap refits disagree wildly on {name} ({lo:.3g} to {hi:.3g}): it is not determined by the data")
    return out


def repeated_data(name: str, epochs: float) -> list[str]:
    if epochs > 1.0 + 1e-9:
        return [f"rung {name} repeated its data ({epochs:.2f} epochs): its loss is not that of fresh data"]
    return []


def memorisation(name: str, train_loss: float, eval_loss: float, rel: float = GAP_REL) -> list[str]:
    """Eval loss well above the train loss at the end of a run: the rung memorised its data."""
    if math.isfinite(train_loss) and math.isfinite(eval_loss) and eval_loss > train_loss * (1 + rel):
        return [f"rung {name}: eval loss {eval_loss:.4g} is {100 * (eval_loss / train_loss - 1):.1f}% above its train "
                f"loss {train_loss:.4g} at the end: it memorised, and nothing should be forecast from it"]
    return []
