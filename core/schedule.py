"""The one learning-rate function, lr(spec, step), used by both engines, the forecaster and the
replanner. A replan changes the schedule's fields (a Rejoin), never this formula.

Shapes: warmup linear from 0 to peak over `warmup` steps, then
  linear / cosine: decay from peak at the end of warmup (or decay_start) to min_lr_ratio x peak
                   at decay_end, flat after;
  wsd:             flat at peak until decay_start (default 80%), then linear to the minimum;
  constant:        flat at peak.
A Rejoin at step r re-times the decay: before r the schedule is the parent's (with its own total
steps); from r it goes, in the same decay shape, from the parent's lr(r) to the minimum at the new
decay end.
"""

from __future__ import annotations

import numpy as np

from core.spec import ScheduleSpec, Spec


def _decay(frac: np.ndarray, shape: str) -> np.ndarray:
    """Multiplier from 1 (frac 0) to 0 (frac 1) of the distance between start and minimum."""
    frac = np.clip(frac, 0.0, 1.0)
    if shape == "cosine":
        return 0.5 * (1.0 + np.cos(np.pi * frac))
    return 1.0 - frac


def _base_ratio(sched: ScheduleSpec, steps: np.ndarray, total: int) -> np.ndarray:
    warm = sched.warmup_steps if sched.warmup_steps is not None else int(round(sched.warmup_frac * total))
    end = max(int(round(sched.decay_end_frac * total)), 1)
    if sched.decay == "wsd":
        start = int(round((sched.decay_start_frac if sched.decay_start_frac is not None else 0.8) * total))
    else:
        start = int(round(sched.decay_start_frac * total)) if sched.decay_start_frac is not None else warm
    start = min(max(start, warm), end)
    m = sched.min_lr_ratio
    if sched.decay == "constant":
        ratio = np.ones_like(steps, dtype=np.float64)
    else:
        span = max(end - start, 1)
        ratio = m + (1.0 - m) * _decay((steps - start) / span, "cosine" if sched.decay == "cosine" else "linear")
        ratio = np.where(steps < start, 1.0, ratio)
    if warm > 0:
        ratio = np.where(steps < warm, (steps + 1) / warm, ratio)
    return ratio


def lr_ratio(sched: ScheduleSpec, steps, total_steps: int) -> np.ndarray:
    """LR as a fraction of peak at each step (vectorised)."""
    steps = np.asarray(steps, dtype=np.float64)
    if not sched.rejoins:
        return _base_ratio(sched, steps, total_steps)
    *earlier, last = sched.rejoins
    prev = sched.model_copy(update={"rejoins": tuple(earlier)})
    before = lr_ratio(prev, steps, last.prev_total_steps)
    at_join = float(lr_ratio(prev, np.array([last.step]), last.prev_total_steps)[0])
    end = max(int(round(sched.decay_end_frac * total_steps)), last.step + 1)
    m = sched.min_lr_ratio
    shape = "cosine" if sched.decay == "cosine" else "linear"
    after = m + (at_join - m) * _decay((steps - last.step) / (end - last.step), shape)
    return np.where(steps < last.step, before, after)


def lr_at(spec: Spec, steps) -> np.ndarray:
    """Learning rate at each step of `steps` (array-like) for this spec."""
    return spec.optim.peak_lr * lr_ratio(spec.schedule, steps, spec.total_steps)


def lr(spec: Spec, step: int) -> float:
    return float(lr_at(spec, np.array([step]))[0])
