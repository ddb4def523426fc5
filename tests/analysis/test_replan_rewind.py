"""Where a replan's rewind resumes: the latest kept checkpoint strictly before the earliest critical
onset, the run's own, else its lineage parent's; none before it, no rewind. The run dirs are real
(the ledger's layout, the engine's checkpoint writer, the run dir's metrics writer); the monitor
reads them as `ladder replan` does."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from analysis.monitor.flags import Flag
from analysis.replan.contingency import RunState, make_replan
from analysis.replan.specs import derive
from analysis.runs.metrics import read_metrics_frame, resolve_run
from core.rundir import RunDir
from core.schedule import lr_at
from engines.checkpoint import init_from_checkpoint, save_checkpoint, step_dir_name
from ladder.presets import micro_spec

TOKENS_PER_STEP = 512  # micro spec: 8 sequences of 64 tokens


def proxy_spec(name="rw", steps=1000, **changes):
    return micro_spec(name, **{"data.total_tokens": TOKENS_PER_STEP * steps, "run.checkpoint_every": 10,
                               "run.keep_checkpoints": 100, "run.eval_every": 10**6, **changes})


def run_dir_with(root: Path, spec, checkpoints, upto: int, nan_from: int | None = None,
                 seed: Path | None = None) -> Path:
    """A run dir in the ledger's layout: its spec, metrics for steps 0..upto (a smooth falling
    loss, NaN from `nan_from` on), and checkpoints at `checkpoints` (tiny arrays: the replan reads
    only which checkpoints exist and whose they are). With `seed` (a parent's checkpoint) the run
    is seeded from it as a replan's continuation is, the parent's metrics before it copied."""
    from ladder import ledger

    d = ledger.run_dir_for(root, "px", spec)
    start = 0
    if seed is not None:
        init_from_checkpoint(d, seed, metrics_from=seed.parent.parent)
        start = int(seed.name[5:])
    ledger.write_spec_file(d, spec)
    w = RunDir(d).metrics_writer(resume_step=start)
    try:
        for s in range(start, upto + 1):
            loss = float("nan") if nan_from is not None and s >= nan_from else 2.5 + 3 * np.exp(-s / 30.0)
            w.write({"step": s, "tokens": (s + 1) * spec.data.tokens_per_step, "loss": loss, "grad_norm": 0.8,
                     "lr": float(lr_at(spec, [s])[0]), "tokens_per_s": 512.0, "time": float(s)})
    finally:
        w.close()
    for step in checkpoints:
        save_checkpoint(d, step, {"w": np.zeros(2)}, {"m/w": np.zeros(2), "v/w": np.zeros(2)},
                        {"spec_id": spec.id}, keep=10**6)
    return d


def state_of(run_dir: Path) -> RunState:
    ref = resolve_run(str(run_dir))
    return RunState.build(read_metrics_frame(run_dir), ref.spec, ref, tokens_per_s=512.0, now=1.9e9)


def rewinds(plan):
    return [o for o in plan.options if o.kind.startswith("rewind")]


def test_the_rewind_resumes_from_the_latest_own_checkpoint_before_the_critical_onset(tmp_path):
    """Checkpoints 100, 200, 300, NaN from step 250: 200, not the later 300 nor the earlier 100."""
    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [100, 200, 300], upto=310, nan_from=250)
    plan = make_replan(state_of(d), forecaster=None)
    rw = rewinds(plan)
    assert {o.kind for o in rw} == {"rewind_zloss", "rewind_lower_lr", "rewind_redraw"}
    for o in rw:
        assert o.resume_step == 200 and o.spec.lineage.resume_step == 200
        assert o.resume_checkpoint == d / "checkpoints" / step_dir_name(200) and o.resume_checkpoint.is_dir()
        assert o.resume_dir is None and o.spec.lineage.parent_id == spec.id


def test_a_checkpoint_at_the_onset_step_itself_is_not_rewound_to(tmp_path):
    """A checkpoint at step c holds the weights step c computes its loss with: NaN from 200 on
    makes checkpoint 200 part of the trouble, and the rewind goes to 100."""
    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [100, 200, 300], upto=310, nan_from=200)
    assert {o.resume_step for o in rewinds(make_replan(state_of(d), forecaster=None))} == {100}


def test_the_estimated_onset_of_a_critical_flag_not_its_first_step_sets_the_rewind(tmp_path):
    """A calibrated sequential test alarms at step 250 on a change it dates to step 150: the rewind
    goes to 100, before the change, not to 200 (before the alarm only)."""
    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [100, 200, 300], upto=310)
    st = state_of(d)
    band = Flag("loss_above_band", "critical", 250, {"text": "loss above its healthy band", "test": "level",
                                                     "onset_step": 150})
    st.report = replace(st.report, flags=[*st.report.flags, band])
    rw = rewinds(make_replan(st, forecaster=None))
    assert rw and {o.resume_step for o in rw} == {100}
    assert "onset at step 150" in rw[0].reason and "loss_above_band" in rw[0].reason


def test_the_earliest_critical_flag_sets_the_rewind_and_warnings_before_it_do_not(tmp_path):
    """A warning at step 120 and a critical token-drop flag at 130 (whose remedy is capacity, not a
    rewind) precede the NaN at 250: the rewind still goes to 200."""
    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [100, 200, 300], upto=310, nan_from=250)
    st = state_of(d)
    extra = [Flag("loss_spike", "warning", 120, {"text": "a spike"}),
             Flag("token_drops", "critical", 130, {"text": "drops", "drop_frac_last": 0.2})]
    st.report = replace(st.report, flags=[*st.report.flags, *extra])
    assert {o.resume_step for o in rewinds(make_replan(st, forecaster=None))} == {200}


def lineage(tmp_path: Path, child_checkpoints, nan_from: int):
    """A parent with checkpoints 20, 40, 60 and a child resumed from its step 50 (the child's seed
    checkpoint rotated away: it keeps `child_checkpoints`), NaN from `nan_from`."""
    parent = proxy_spec("p")
    child = derive(parent, "rewind_lower_lr", "r", 50, **{"optim.peak_lr": parent.optim.peak_lr / 2})
    assert child.id != parent.id
    p_dir = run_dir_with(tmp_path, parent, [20, 40, 60], upto=65)
    c_dir = run_dir_with(tmp_path, child, child_checkpoints, upto=75, nan_from=nan_from)
    return parent, p_dir, child, c_dir


def test_with_no_own_checkpoint_before_the_onset_the_rewind_resumes_from_the_parents_latest_before_the_branch(tmp_path):
    """Onset 55, the child keeps 60 and 70: the parent's 40, not its 60 (past the branch at 50,
    another history) nor its 20."""
    parent, p_dir, child, c_dir = lineage(tmp_path, [60, 70], nan_from=55)
    rw = rewinds(make_replan(state_of(c_dir), forecaster=None))
    assert rw
    for o in rw:
        assert o.resume_step == 40 and o.spec.lineage.resume_step == 40
        assert o.spec.lineage.parent_id == parent.id and o.resume_dir == p_dir
        assert o.resume_checkpoint == p_dir / "checkpoints" / step_dir_name(40) and o.resume_checkpoint.is_dir()


def test_an_onset_before_the_branch_point_rewinds_to_the_parents_checkpoint_before_the_onset(tmp_path):
    """The child's sequential test dates a change to step 30, before it branched at 50: the
    parent's 20, not its 40 (after the onset though before the branch)."""
    parent, p_dir, child, c_dir = lineage(tmp_path, [60, 70], nan_from=10**6)
    st = state_of(c_dir)
    band = Flag("grad_norm_above_band", "critical", 62, {"text": "grad norm above its healthy band", "onset_step": 30})
    st.report = replace(st.report, flags=[*st.report.flags, band])
    rw = rewinds(make_replan(st, forecaster=None))
    assert rw and {(o.resume_step, o.resume_dir) for o in rw} == {(20, p_dir)}


def test_the_runs_own_checkpoint_before_the_onset_wins_over_its_parents(tmp_path):
    """Onset 65, the child keeps 60 and 70: its own 60, not the parent's 40."""
    parent, p_dir, child, c_dir = lineage(tmp_path, [60, 70], nan_from=65)
    rw = rewinds(make_replan(state_of(c_dir), forecaster=None))
    assert rw and {(o.resume_step, o.resume_dir, o.spec.lineage.parent_id) for o in rw} == {(60, None, child.id)}


def test_a_rewind_to_the_runs_seed_checkpoint_names_the_run_whose_weights_it_holds(tmp_path):
    """A child seeded from the parent's checkpoint 50 keeps that copy: onset 55 rewinds to it, and
    the option's lineage names the parent (the engine continues a checkpoint only of the spec it
    names), not the child."""
    parent = proxy_spec("p")
    child = derive(parent, "rewind_lower_lr", "r", 50, **{"optim.peak_lr": parent.optim.peak_lr / 2})
    assert child.id != parent.id
    p_dir = run_dir_with(tmp_path, parent, [20, 40, 50, 60], upto=65)
    c_dir = run_dir_with(tmp_path, child, [60, 70], upto=75, nan_from=55,
                         seed=p_dir / "checkpoints" / step_dir_name(50))
    rw = rewinds(make_replan(state_of(c_dir), forecaster=None))
    assert rw
    for o in rw:
        assert (o.resume_step, o.spec.lineage.parent_id) == (50, parent.id)
        assert o.resume_checkpoint == c_dir / "checkpoints" / step_dir_name(50) and o.resume_dir == c_dir


def test_with_no_checkpoint_before_the_onset_anywhere_there_is_no_rewind_and_the_replan_says_why(tmp_path):
    """Checkpoint 300 only, NaN from 250, no lineage: no rewind option (not a fresh start from step
    0), and replan.json's notes and recommendation give the reason."""
    from tests.analysis.test_replan import ladder_in_process

    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [300], upto=310, nan_from=250)
    rc, err = ladder_in_process("replan", d, "--tokens-per-s", 512, "--out", tmp_path / "plan")
    assert rc == 0, err
    doc = json.loads((tmp_path / "plan" / "replan.json").read_text())
    assert [o["kind"] for o in doc["options"] if o["kind"].startswith("rewind")] == []
    why = [n for n in doc["notes"] if n.startswith("no rewind option")]
    assert len(why) == 1 and "non_finite" in why[0] and "step 250" in why[0] and "[300]" in why[0]
    assert why[0] in doc["recommendation"] and doc["recommended"] is None


def test_the_rewind_options_text_names_the_checkpoint_path_and_step_the_onset_and_the_flag(tmp_path):
    from tests.analysis.test_replan import ladder_in_process

    spec = proxy_spec()
    d = run_dir_with(tmp_path, spec, [100, 200, 300], upto=310, nan_from=250)
    rc, err = ladder_in_process("replan", d, "--tokens-per-s", 512, "--out", tmp_path / "plan")
    assert rc == 0, err
    doc = json.loads((tmp_path / "plan" / "replan.json").read_text())
    ckpt = str(d / "checkpoints" / step_dir_name(200))
    rw = [o for o in doc["options"] if o["kind"].startswith("rewind")]
    assert len(rw) == 3
    for o in rw:
        assert o["resume_checkpoint"] == ckpt and o["title"].startswith("rewind to checkpoint 200")
        for text in (o["reason"], o["note"]):
            assert ckpt in text and "checkpoint step 200" in text
            assert "critical non_finite flag, onset at step 250" in text
