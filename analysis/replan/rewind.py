"""Where a rewind resumes: the latest kept checkpoint strictly before the onset of the run's
earliest critical flag, the run's own or, when the run keeps none that early, one of the run it
continues (its lineage parent, and on up the lineage).

    onset = critical_onset(report)            # Onset | None
    point = rewind_point(state, onset.step)   # RewindPoint | None (nothing kept before the onset)

The onset of a flag is its evidence's `onset_step` where the monitor estimated one (the calibrated
sequential tests: the change began there, before the test alarmed at first_step), else its
first_step. A checkpoint at step c holds the weights after c steps, the ones step c's loss and
gradient are computed with, so a checkpoint at the onset step itself already carries the trouble:
the rewind takes one strictly before it.

Critical flags whose remedy is not a rewind do not count: token drops (the capacity, dropless and
sequence-balance options) and a failed run (a crash, not a fault in the curve: resuming from the
latest checkpoint is keeping the plan).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.monitor.flags import Flag, MonitorReport
from engines.checkpoint import STATE_FILE, step_dir_name

if TYPE_CHECKING:
    from analysis.replan.state import RunState

__all__ = ["NOT_REWOUND", "Onset", "RewindPoint", "critical_onset", "no_rewind_reason", "rewind_point"]

NOT_REWOUND = ("token_drops", "run_failed")


@dataclass(frozen=True)
class Onset:
    step: int
    flag: Flag
    estimated: bool  # the flag's evidence onset_step (before its first_step), not its first_step

    def describe(self) -> str:
        f = self.flag
        how = (f"its estimated onset (the change began near step {self.step}, flagged at step {f.first_step})"
               if self.estimated else f"its first step {self.step}")
        return f"critical {f.kind} flag, onset at step {self.step}: {how}"


@dataclass(frozen=True)
class RewindPoint:
    step: int
    path: Path | None  # the checkpoint directory (None where the checkpoints are assumed: no run dir)
    run_dir: Path | None  # the run dir it lies in, where its spec id is not the replanned run's; else None
    spec_id: str | None  # the spec id of the run whose state it holds, where not the replanned run's

    @property
    def own(self) -> bool:
        return self.spec_id is None

    def describe(self) -> str:
        where = str(self.path) if self.path is not None else "path unknown: no run directory, checkpoints assumed"
        whose = "the run's own" if self.own else f"the state of run {self.spec_id}, which this run continues"
        return f"checkpoint step {self.step} ({whose}; {where})"


def _checkpoint_spec_id(path: Path) -> str | None:
    try:
        sid = json.loads((path / STATE_FILE).read_text()).get("spec_id")
    except (OSError, ValueError, AttributeError):
        return None
    return sid if isinstance(sid, str) else None


def flag_onset(f: Flag) -> tuple[int, bool]:
    """(onset step, whether it is the evidence's estimate) of one flag."""
    est = f.evidence.get("onset_step") if isinstance(f.evidence, dict) else None
    if isinstance(est, (int, float)) and not isinstance(est, bool) and int(est) <= f.first_step:
        return int(est), int(est) != f.first_step
    return int(f.first_step), False


def critical_onset(report: MonitorReport) -> Onset | None:
    """The earliest onset among the report's critical flags that call for a rewind (all critical
    flags but NOT_REWOUND's kinds); None when there is none. Ties go to the earlier-raised flag."""
    best: Onset | None = None
    for f in report.flags:
        if f.severity != "critical" or f.kind in NOT_REWOUND:
            continue
        step, est = flag_onset(f)
        if best is None or (step, f.first_step) < (best.step, best.flag.first_step):
            best = Onset(step, f, est)
    return best


def rewind_point(st: "RunState", onset: int) -> RewindPoint | None:
    """The latest kept checkpoint strictly before step `onset`: the run's own (st.checkpoints, in
    st.run_dir/checkpoints/) when it keeps one that early; else the newest of the runs it continues
    (st.ancestors: each parent's checkpoints before the step its child resumed from); else None.
    A kept checkpoint of the run whose state is another run's (its seed, copied from the parent)
    resumes as that run's: the option's lineage must name the run the weights come from."""
    own = [c for c in st.checkpoints if c < onset and c <= st.done_steps]
    if own:
        step = max(own)
        if st.checkpoints_assumed or st.run_dir is None:
            return RewindPoint(step, None, None, None)
        path = Path(st.run_dir) / "checkpoints" / step_dir_name(step)
        sid = _checkpoint_spec_id(path)
        if sid is not None and sid != st.spec.id:
            # the run's seed checkpoint (engines.checkpoint.init_from_checkpoint keeps the state of
            # the run it was copied from): resuming it continues that run
            return RewindPoint(step, path, Path(st.run_dir), sid)
        return RewindPoint(step, path, None, None)
    before = [(step, d, sid) for step, d, sid in st.ancestors if step < onset]
    if before:
        step, d, sid = max(before, key=lambda x: x[0])
        return RewindPoint(step, Path(d) / "checkpoints" / step_dir_name(step), Path(d), sid)
    return None


def no_rewind_reason(st: "RunState", onset: Onset) -> str:
    """Why no rewind is offered: nothing kept before the onset, in the run or its lineage."""
    own = f"the run keeps checkpoints {st.checkpoints}" if st.checkpoints else "the run keeps no checkpoint"
    anc = ""
    if st.ancestors:
        steps = sorted({s for s, _, _ in st.ancestors})
        anc = f", the runs it continues {steps}"
    elif st.spec.lineage.parent_id:
        anc = f"; no kept checkpoint of the run it continues ({st.spec.lineage.parent_id}) before its resume step is found"
    return (f"no rewind option: the {onset.describe()}; {own}{anc}; none is before step {onset.step}, "
            "so there is nothing to rewind to short of a fresh start from step 0")
