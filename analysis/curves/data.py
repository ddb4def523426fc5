"""Loss curves as the curve models (analysis.curves.fit) take them: logged steps, the learning-rate
schedule (one value per logged step, or a dense per-step array) and the loss, validated at the
boundary with errors that name the curve and the problem.

Learning rates: `lr` is either one value per logged step (sampled schedule: linear between samples,
before the first sample a linear warmup from 0 at step 0) or a dense per-step array (lr[s] is the
LR of step s, len > last step), e.g. core.schedule.lr_at(spec, np.arange(spec.total_steps)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import InputError

__all__ = ["Curve", "CurveError", "CurveFitError", "check_steps", "dense_lr", "lr_per_step_from_samples"]


class CurveError(InputError):
    """Curves or schedules that cannot be used as given; the message names the problem."""


class CurveFitError(CurveError):
    """A fit that did not converge or cannot describe the curves; it says so instead of numbers."""


# ---- learning rates --------------------------------------------------------------------------------


def lr_per_step_from_samples(step, lr, total_steps: int | None = None) -> np.ndarray:
    """Dense per-step LR from samples at logged steps: linear between samples, before the first
    sample a linear warmup from 0 at step 0, after the last one flat. Length total_steps (default
    last step + 1)."""
    step_n = np.asarray(step, dtype=np.float64)
    lr_n = np.asarray(lr, dtype=np.float64)
    if step_n.ndim != 1 or lr_n.shape != step_n.shape or len(step_n) == 0:
        raise CurveError(f"lr samples: need one LR per step, got {lr_n.shape} LRs for {step_n.shape} steps")
    T = int(step_n[-1]) + 1 if total_steps is None else int(total_steps)
    if step_n[0] > 0:
        step_n, lr_n = np.r_[0.0, step_n], np.r_[0.0, lr_n]
    return np.interp(np.arange(T, dtype=np.float64), step_n, lr_n)


def dense_lr(steps_n: np.ndarray, lr, what: str) -> np.ndarray:
    """Either a dense per-step array (len > last step) or one sample per step (densified)."""
    lr = np.asarray(lr, dtype=np.float64)
    if lr.ndim != 1:
        raise CurveError(f"{what}: lr must be one-dimensional, got shape {lr.shape}")
    if not np.all(np.isfinite(lr)):
        raise CurveError(f"{what}: lr has NaN or infinite values")
    if np.any(lr < 0):
        raise CurveError(f"{what}: lr has negative values")
    last = int(steps_n[-1])
    if len(lr) > last:
        return lr
    if len(lr) == len(steps_n):
        return lr_per_step_from_samples(steps_n, lr)
    raise CurveError(
        f"{what}: lr has {len(lr)} values: give one per logged step ({len(steps_n)}) "
        f"or a per-step schedule covering step {last} (at least {last + 1} values)"
    )


MAX_STEPS = 2**26  # 67M optimiser steps, 50x the longest public LLM runs: the models keep per-step arrays


def check_steps(step, what: str) -> np.ndarray:
    s = np.asarray(step)
    if s.ndim != 1 or len(s) == 0:
        raise CurveError(f"{what}: need a non-empty 1-D array of steps")
    sf = np.asarray(s, dtype=np.float64)
    if not np.all(np.isfinite(sf)):
        raise CurveError(f"{what}: steps have NaN or infinite values")
    if np.any(sf < 0) or np.any(sf != np.round(sf)):
        raise CurveError(f"{what}: steps must be non-negative integers")
    if np.any(np.diff(sf) <= 0):
        i = int(np.flatnonzero(np.diff(sf) <= 0)[0]) + 1
        raise CurveError(f"{what}: steps must be strictly increasing; step {sf[i]:g} follows {sf[i - 1]:g}")
    if sf[-1] >= MAX_STEPS:
        raise CurveError(f"{what}: step {sf[-1]:.0f} is past the {MAX_STEPS:,} steps a curve may span (the curve "
                         "models keep one value per step): is the step column a token count?")
    return sf.astype(np.int64)


@dataclass
class Curve:
    """One loss curve: logged `step`s, the schedule (`lr`: one value per logged step, or a dense
    per-step array), `loss` at those steps (None for a curve only to be predicted) and optionally
    the model's parameter count `params`."""

    step: Any
    lr: Any
    loss: Any = None
    params: float | None = None
    name: str = ""

    def __post_init__(self):
        what = f"curve {self.name!r}" if self.name else "curve"
        self.step = check_steps(self.step, what)
        self.lr_per_step = dense_lr(self.step, self.lr, what)
        self.lr = np.asarray(self.lr, dtype=np.float64)
        if self.loss is not None:
            y = np.asarray(self.loss, dtype=np.float64)
            if y.shape != self.step.shape:
                raise CurveError(f"{what}: {len(y)} losses for {len(self.step)} steps")
            if not np.all(np.isfinite(y)):
                raise CurveError(f"{what}: loss has NaN or infinite values")
            if np.any(y <= 0):
                raise CurveError(f"{what}: loss must be positive (the fit is on log loss)")
            self.loss = y
        if self.params is not None:
            p = float(self.params)
            if not math.isfinite(p) or p <= 0:
                raise CurveError(f"{what}: params must be a positive parameter count, got {self.params!r}")
            self.params = p
        if self.lr_per_step[self.step].max() <= 0:
            raise CurveError(f"{what}: the learning rate is zero at every logged step")

    @classmethod
    def from_schedule(cls, step, lr_per_step, loss=None, params=None, name: str = "") -> "Curve":
        """A curve whose schedule is a dense per-step LR array (lr_per_step[s] for step s)."""
        step = check_steps(step, f"curve {name!r}")
        lr_per_step = np.asarray(lr_per_step, dtype=np.float64)
        if len(lr_per_step) <= step[-1]:
            raise CurveError(f"curve {name!r}: lr_per_step has {len(lr_per_step)} values, steps reach {step[-1]}")
        return cls(step=step, lr=lr_per_step, loss=loss, params=params, name=name)
