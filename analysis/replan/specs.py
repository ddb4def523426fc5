"""An option's spec from its parent's: the lineage it records, and the horizon re-timed from a
checkpoint (the LR decay through core.spec.Rejoin, data phases and context stages at their token
positions or budget fractions), checked against the parent's schedule."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from core.schedule import lr_at
from core.spec import Rejoin, Spec

__all__ = ["derive", "shorten_spec"]


def derive(parent: Spec, kind: str, reason: str, resume_step: int, *, resumes: str | None = None,
           **changes: Any) -> Spec:
    """`parent` with `changes`, named <base>+<kind>, continuing a run from `resume_step`: the
    parent's own, or the run of spec id `resumes` (an earlier run in the parent's lineage, when the
    checkpoint resumed from is that run's)."""
    base = parent.name.split("+", 1)[0]
    lineage = {"parent_id": resumes or parent.id, "reason": reason, "resume_step": resume_step}
    return parent.replace(**{"name": f"{base}+{kind}", "lineage": lineage, **changes})


def _verify_rejoin(old: Spec, new: Spec, join: int) -> None:
    """The re-timed schedule must be the old one before the join, continuous at it, and reach the
    minimum at the new end. A failure here is a bug, not bad input."""
    before = np.arange(join)
    if join and not np.allclose(lr_at(new, before), lr_at(old, before), rtol=1e-12, atol=0):
        raise AssertionError("re-timed schedule differs from the parent's before the join")
    if join < old.total_steps and not math.isclose(float(lr_at(new, [join])[0]), float(lr_at(old, [join])[0]), rel_tol=1e-9):
        raise AssertionError("re-timed schedule is not continuous at the join")
    end = max(int(round(new.schedule.decay_end_frac * new.total_steps)), join + 1)
    want = new.optim.peak_lr * new.schedule.min_lr_ratio
    if new.schedule.decay != "constant" and not math.isclose(float(lr_at(new, [end])[0]), want, rel_tol=1e-9):
        raise AssertionError("re-timed schedule does not reach min_lr_ratio x peak at the new end")


def _phases(spec: Spec, old_total: int, new_total: int, join: int, keep_fraction: bool) -> list[dict]:
    """Data phases for a new horizon. Started phases keep their exact start step; the others keep
    their token position (keep_fraction=False; dropped when past the new end) or their fraction of
    the new budget (keep_fraction=True)."""
    out = []
    for ph in spec.data.phases:
        start = int(ph.start_frac * old_total)  # engines/data.py: floor(start_frac * total_steps)
        d = ph.model_dump(mode="json")
        if start <= join or not keep_fraction:
            if start + 0.5 >= new_total:
                continue
            # (start + 0.5) / new: floor(frac * new) is exactly `start` despite float rounding
            d["start_frac"] = (start + 0.5) / new_total
        out.append(d)
    return out


def _context_stages(spec: Spec, old_total: int, new_total: int, join: int) -> list[dict]:
    out = []
    for cs in spec.data.context_stages:
        start = int(cs.start_frac * old_total)
        d = cs.model_dump(mode="json")
        if start <= join and not cs.gated:
            if start + 0.5 >= new_total:
                continue
            d["start_frac"] = (start + 0.5) / new_total
        out.append(d)
    return out


def shorten_spec(spec: Spec, join: int, new_total: int, keep_fraction: bool, kind: str, reason: str) -> Spec:
    """The spec with its horizon cut to `new_total` steps from the checkpoint at `join`."""
    old_total = spec.total_steps
    sched = spec.schedule
    warm = sched.warmup_steps if sched.warmup_steps is not None else int(round(sched.warmup_frac * old_total))
    changes: dict[str, Any] = {"data.total_tokens": new_total * spec.data.tokens_per_step}
    flat_until = None
    if sched.decay == "constant":
        flat_until = new_total
    elif sched.decay == "wsd" and not sched.rejoins:
        flat_until = int(round((sched.decay_start_frac if sched.decay_start_frac is not None else 0.8) * new_total))
    if flat_until is not None and join <= flat_until and join >= warm:
        # Still in the flat part: the new total moves the decay; pin the warmup in steps.
        changes["schedule.warmup_steps"] = warm
    else:
        changes["schedule.rejoins"] = [r.model_dump() for r in sched.rejoins] + [
            Rejoin(step=join, prev_total_steps=old_total).model_dump()
        ]
    if spec.data.phases:
        changes["data.phases"] = _phases(spec, old_total, new_total, join, keep_fraction)
    if spec.data.context_stages:
        changes["data.context_stages"] = _context_stages(spec, old_total, new_total, join)
    new = derive(spec, kind, reason, join, **changes)
    _verify_rejoin(spec, new, join)
    return new
