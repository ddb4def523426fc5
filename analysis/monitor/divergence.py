"""When a run's trouble began: the monitor's flags that call for a rewind and the onset they point
at (the replanner rewinds to before it; the run forecaster fits only the healthy points)."""

from __future__ import annotations

from typing import Any

from analysis.monitor.watch import MonitorReport

__all__ = ["TRIGGER_KINDS", "PRECURSOR_KINDS", "divergence_onset"]

# Flags that call for a rewind: NaN/inf, the run's own "diverged", a loss jump, or grad norm past the
# critical threshold. Spikes, grad-norm growth and grad norm over the warning threshold are routine
# in small noisy runs and call for nothing by themselves; when one comes shortly before a trigger,
# the trouble began there, and the rewind goes back before it.
TRIGGER_KINDS = ("non_finite", "run_diverged", "loss_jump")
PRECURSOR_KINDS = ("loss_spike", "grad_norm_spike", "grad_norm_high", "grad_norm_growth", "grad_norm_above_envelope")


def _is_trigger(f) -> bool:
    return f.kind in TRIGGER_KINDS or (f.kind == "grad_norm_high" and f.severity == "critical")


def divergence_onset(report: MonitorReport, total_steps: int) -> tuple[int, Any] | None:
    """(first step of the trouble, the flag that calls for a rewind), or None. The onset is the
    earliest trigger, moved back to any precursor within the lookback (max(10 steps, 5% of the
    run)) before it."""
    triggers = [f for f in report.flags if _is_trigger(f)]
    if not triggers:
        return None
    trig = min(triggers, key=lambda f: f.first_step)
    start = trig.first_step
    lookback = max(10, int(0.05 * total_steps))
    for f in report.flags:
        if f.kind not in PRECURSOR_KINDS:
            continue
        cands = [f.first_step] + [int(x) for x in f.evidence.get("spike_steps", [])]
        near = [x for x in cands if start - lookback <= x <= start]
        if near:
            start = min(start, min(near))
    return start, trig
