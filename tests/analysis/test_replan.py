"""Replans of real proxy runs (the torch engine on real text) and of hand-made states."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.runs.metrics import ancestor_checkpoints, read_metrics_frame
from analysis.monitor.watch import monitor
from analysis.replan.contingency import RunState, make_replan, shorten_spec
from analysis.replan.state import OptionForecast
from analysis.replan.specs import derive
from engines.base import read_metrics
from engines.checkpoint import init_from_checkpoint, save_checkpoint, step_dir_name
from engines.registry import get_engine
from ladder.presets import micro_spec
from core.schedule import lr_at
from core.spec import load_spec, save_spec
from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]
TOKENS_PER_STEP = 512  # micro spec: 8 sequences of 64 tokens


def proxy_spec(name="proxy", steps=320, **changes):
    return micro_spec(name, **{"data.total_tokens": TOKENS_PER_STEP * steps, "run.checkpoint_every": 10,
                               "run.keep_checkpoints": 5, "run.eval_every": 10**6, **changes})


def train(spec, run_dir: Path, stop_after: int | None = None) -> None:
    """Real training with the torch engine; stop_after leaves the run mid-way (as if still going)."""
    for m in get_engine("torch").train(spec, run_dir):
        if stop_after is not None and m.step >= stop_after:
            break


def ladder(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return cli_fork.ladder(*args, cwd=cwd, env=env, timeout=600)  # catches a hang only: --apply trains through Ray


def ladder_in_process(*args) -> tuple[int, str]:
    """The CLI's own entry (run_cli) in this process: exit code and stderr, whitespace-normalised."""
    import contextlib
    import io

    from ladder.cli import app
    from ladder.errors import run_cli

    err, old = io.StringIO(), sys.argv
    sys.argv = ["ladder", *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run_cli(app)
    finally:
        sys.argv = old
    return rc, " ".join(err.getvalue().split())


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A 320-step proxy run in the ledger's layout, stopped after step 79: a quarter of its tokens
    done, checkpoints 40..80 kept. Returns (spec, run dir, ledger root)."""
    from ladder import ledger

    root = tmp_path_factory.mktemp("ledger")
    spec = proxy_spec()
    d = ledger.run_dir_for(root, "px", spec)
    ledger.write_spec_file(d, spec)
    train(spec, d, stop_after=79)
    return spec, d, root


# ---- real runs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shortened(live_run, tmp_path_factory):
    """`ladder replan` of the live run with a tight deadline, applied: option 2 (shorten) submitted
    through the controller (real Ray, real MLflow) as a continuation from its checkpoint. RUN_ID is
    the spec id, resolved through the ledger. Returns (plan JSON, parent spec, parent dir)."""
    spec, run_dir, root = live_run
    tmp = tmp_path_factory.mktemp("shorten")
    deadline = time.time() + 90  # at 512 tokens/s (one step a second) ~90 more steps fit
    r = ladder("replan", spec.id, "--root", root, "--spec", run_dir / "spec.yaml", "--deadline", iso(deadline),
               "--tokens-per-s", TOKENS_PER_STEP, "--out", tmp / "plan", "--json", "--apply", 2, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), spec, run_dir


@pytest.mark.slow
def test_tight_deadline_shortens_the_horizon_and_the_continuation_follows_the_new_schedule_exactly(shortened):
    plan, spec, run_dir = shortened
    keep, short = plan["options"][0], plan["options"][1]
    assert short["kind"] == "shorten" and short["allowed"] and short["meets_deadline"]
    assert keep["meets_deadline"] is False and plan["recommended"] == 2
    new = load_spec(short["spec_path"])
    assert new.id != spec.id and new.lineage.parent_id == spec.id and new.lineage.resume_step == 80
    assert "deadline" in new.lineage.reason
    # one step a second: the steps that fit between the plan's own "now" and the deadline (the CLI's
    # start-up under load eats into the 90 s the fixture gave, so the window is read from the plan)
    left = (datetime.fromisoformat(plan["deadline"].replace("Z", "+00:00"))
            - datetime.fromisoformat(plan["now"].replace("Z", "+00:00"))).total_seconds()
    assert 0 < left <= 91
    assert 80 + left - 16 <= new.total_steps <= 80 + left + 1 < spec.total_steps

    child = Path(plan["applied"]["run_dir"])
    assert plan["applied"]["ok"] and json.loads((child / "status.json").read_text())["state"] == "finished"
    recs = read_metrics(child)
    steps = np.array([m["step"] for m in recs])
    assert steps.tolist() == list(range(new.total_steps))
    # the LR of every step, the parent's before the join and the continuation's after, is the new schedule's
    np.testing.assert_allclose([m["lr"] for m in recs], lr_at(new, steps), rtol=1e-12, atol=0)
    assert [m["loss"] for m in recs[:80]] == [m["loss"] for m in read_metrics(run_dir)[:80]]


@pytest.mark.slow
def test_the_continuation_final_loss_lands_in_the_replan_forecast_interval(shortened):
    plan, _, _ = shortened
    short = plan["options"][1]
    recs = read_metrics(plan["applied"]["run_dir"])
    final = float(np.mean([m["loss"] for m in recs[-5:]]))  # what the forecast is of: the last 5 steps' mean
    assert short["forecast_lo"] <= final <= short["forecast_hi"], (final, short)


@pytest.mark.slow
def test_a_replan_forecast_interval_as_wide_as_the_fall_so_far_says_so(shortened):
    """On this 80-step micro run the curve fit may not tell the annealing term from the power law
    (its LR decays from the start), and its interval then spans more than the run has fallen: the
    plan must say so of exactly the options whose interval does."""
    plan, _, _ = shortened
    fall = plan["run"]["fall_so_far"]
    assert fall > 0
    for o in plan["options"]:
        if o["forecast_lo"] is None:
            continue
        wide = o["forecast_hi"] - o["forecast_lo"] >= fall
        said = any(n.startswith(f"option {o['n']} ({o['kind']}): ") and "as wide as the run's whole fall" in n
                   for n in plan["notes"])
        assert wide == said, (o, fall, plan["notes"])


FAULT_STEP = 70


@pytest.fixture(scope="module")
def faulty(live_run, tmp_path_factory):
    """A continuation of the live run from its checkpoint 70 with the fault injected there (peak LR
    30x, z-loss off), trained to step 95, and `ladder replan` of it. Returns (faulty spec, its run
    dir, plan JSON, tmp dir)."""
    parent, parent_dir, _ = live_run
    tmp = tmp_path_factory.mktemp("faulty")
    faulty = parent.replace(**{"optim.peak_lr": 0.1, "optim.z_loss": 0.0, "lineage.parent_id": parent.id,
                               "lineage.resume_step": FAULT_STEP, "lineage.reason": "injected fault"})
    run_dir = tmp / "faulty"
    init_from_checkpoint(run_dir, parent_dir / "checkpoints" / step_dir_name(FAULT_STEP), metrics_from=parent_dir)
    save_spec(faulty, run_dir / "spec.yaml")
    train(faulty, run_dir, stop_after=FAULT_STEP + 25)
    r = ladder("replan", run_dir, "--spec", run_dir / "spec.yaml", "--out", tmp / "plan", "--json", cwd=tmp)
    assert r.returncode == 0, r.stderr
    return faulty, run_dir, json.loads(r.stdout), tmp


@pytest.mark.slow
def test_injected_lr_spike_is_flagged_within_three_steps_of_the_fault_and_compare_exits_critical(live_run, faulty):
    parent, parent_dir, _ = live_run
    spec, run_dir, _, tmp = faulty
    report = monitor(read_metrics_frame(run_dir), spec)
    # The parent's own early noise (512-token batches) may already be flagged before the fault;
    # what the fault adds must be flagged within three steps of it, and nothing new before it.
    before = {(f.kind, f.first_step) for f in monitor(read_metrics_frame(parent_dir), parent).flags}
    new = [f for f in report.flags if f.severity in ("warning", "critical") and (f.kind, f.first_step) not in before]
    first = min(f.first_step for f in new)
    assert FAULT_STEP <= first <= FAULT_STEP + 3, [(f.kind, f.first_step) for f in report.flags]
    assert report.critical
    r = ladder("compare", run_dir, cwd=tmp)
    assert r.returncode == 3, r.stdout + r.stderr


@pytest.mark.slow
def test_the_rewind_of_an_injected_fault_resumes_from_the_latest_checkpoint_before_its_critical_onset(live_run, faulty):
    """The faulty run keeps its seed checkpoint 70 (a copy of the parent's, from before the fault's
    first step) and 80, 90; the parent keeps 40..60 before the branch. A critical onset after step
    70 rewinds to the seed copy in the faulty run's dir, its lineage naming the parent (whose
    weights it holds); one at 70 (the seed's weights already produced it) to the parent's 60."""
    from analysis.replan.rewind import critical_onset

    parent, parent_dir, _ = live_run
    spec, run_dir, plan, _ = faulty
    onset = critical_onset(monitor(read_metrics_frame(run_dir), spec))
    assert onset is not None and onset.step >= FAULT_STEP
    want = (70, run_dir, str(run_dir), parent.id) if onset.step > FAULT_STEP else (60, parent_dir, str(parent_dir), parent.id)
    rewinds = [o for o in plan["options"] if o["kind"].startswith("rewind_")]
    assert {o["kind"] for o in rewinds} == {"rewind_zloss", "rewind_lower_lr", "rewind_redraw"}
    for o in rewinds:
        s = load_spec(o["spec_path"])
        assert (o["resume_step"], s.lineage.resume_step) == (want[0], want[0])
        assert o["resume_checkpoint"] == str(want[1] / "checkpoints" / step_dir_name(want[0]))
        assert (o["resume_run_dir"], s.lineage.parent_id) == (want[2], want[3])
        assert f"onset at step {onset.step}" in o["reason"] and onset.flag.kind in o["reason"]


@pytest.mark.slow
def test_a_divergence_with_z_loss_off_recommends_the_z_loss_rewind_and_says_batches_cannot_be_skipped(faulty):
    _, _, plan, _ = faulty
    z = next(o for o in plan["options"] if o["kind"] == "rewind_zloss")
    assert load_spec(z["spec_path"]).optim.z_loss == 1e-4
    assert plan["recommended"] == z["n"] and "rewind_zloss" in plan["recommendation"]
    assert any("skipping the offending batches is not possible" in n for n in plan["notes"])


@pytest.mark.slow
def test_the_lower_lr_rewind_continues_from_its_checkpoint_at_the_lower_peak(faulty, tmp_path):
    """Seeded from the option's checkpoint, the engine trains on at the lower peak LR, its curve
    before the join the one of the run whose checkpoint it is."""
    spec, run_dir, plan, _ = faulty
    lower = next(o for o in plan["options"] if o["kind"] == "rewind_lower_lr")
    new, join = load_spec(lower["spec_path"]), lower["resume_step"]
    src = Path(lower["resume_run_dir"] or run_dir)
    child = tmp_path / "child"
    init_from_checkpoint(child, lower["resume_checkpoint"], metrics_from=src)
    save_spec(new, child / "spec.yaml")
    train(new, child, stop_after=join + 2)
    recs = read_metrics(child)
    assert [m["step"] for m in recs] == list(range(join + 3))
    assert [m["loss"] for m in recs[:join]] == [m["loss"] for m in read_metrics(src)[:join]]
    assert new.optim.peak_lr == spec.optim.peak_lr * 0.5
    np.testing.assert_allclose([m["lr"] for m in recs[join:]], lr_at(new, np.arange(join, join + 3)), rtol=1e-12)


# ---- bad input: a clear error and nothing written -------------------------------------------


def test_bad_inputs_are_clear_errors_and_write_nothing(live_run, tmp_path):
    spec, run_dir, _ = live_run
    out = tmp_path / "plan"
    other = proxy_spec(**{"optim.peak_lr": 1e-3})
    save_spec(other, tmp_path / "other.yaml")
    (tmp_path / "noloss.csv").write_text("step,tokens\n0,512\n1,1024\n")
    cases = [
        (("replan", "feedfacecafebeef", "--spec", run_dir / "spec.yaml", "--root", tmp_path / "ledger"),
         "unknown run id 'feedfacecafebeef'"),
        (("replan", "--metrics", tmp_path / "noloss.csv", "--spec", run_dir / "spec.yaml"), "no loss column"),
        (("replan", run_dir, "--spec", run_dir / "spec.yaml", "--deadline", "2020-01-01"), "in the past"),
        (("replan", run_dir, "--spec", tmp_path / "other.yaml"), "is not the run's"),
        (("replan", "--metrics", run_dir / "metrics.jsonl", "--spec", tmp_path / "other.yaml"), "is not the run's"),
    ]
    for args, msg in cases:
        rc, err = ladder_in_process(*args, "--out", out)
        assert rc == 2 and msg in err, (args, err)
        assert not out.exists()
    assert not (run_dir / "replans").exists()


# ---- the options, on hand-made states -------------------------------------------------------


def state_of(spec, upto: int, tokens_per_s=512.0, now=1.9e9, **cols) -> RunState:
    steps = np.arange(upto + 1)
    df = pd.DataFrame({"step": steps, "tokens": (steps + 1) * spec.data.tokens_per_step,
                       "loss": 2.5 + 3 * np.exp(-steps / 30.0), "grad_norm": np.full(len(steps), 0.8),
                       "lr": lr_at(spec, steps), **cols})
    return RunState.build(df, spec, None, tokens_per_s=tokens_per_s, now=now)


@pytest.mark.parametrize("decay", ["linear", "cosine", "wsd", "constant"])
def test_a_shortened_horizon_keeps_the_past_schedule_and_reaches_the_minimum_at_the_new_end(decay):
    spec = proxy_spec(steps=1000, **{"schedule.decay": decay})
    new = shorten_spec(spec, join=200, new_total=600, keep_fraction=True, kind="shorten", reason="test")
    before = np.arange(200)
    np.testing.assert_array_equal(lr_at(new, before), lr_at(spec, before))
    assert lr_at(new, [200])[0] == pytest.approx(lr_at(spec, [200])[0], rel=1e-12)
    want_end = spec.optim.peak_lr * (1.0 if decay == "constant" else spec.schedule.min_lr_ratio)
    assert lr_at(new, [600])[0] == pytest.approx(want_end, rel=1e-9)
    assert np.all(np.diff(lr_at(new, np.arange(200, 600))) <= 1e-15)  # never re-warms


def test_the_mix_option_keeps_the_80_20_split_of_the_new_budget():
    phases = [{"name": "midtrain", "start_frac": 0.8, "weights": {"code": 0.2, "docs": 0.8}}]
    spec = proxy_spec(steps=1000, **{"data.phases": phases})
    st = state_of(spec, upto=199)  # 20% of the budget
    plan = make_replan(st, deadline=st.now + 400 * TOKENS_PER_STEP / 512.0, forecaster=None)
    by = {o.kind: o for o in plan.options}
    assert by["shorten"].spec.total_steps == by["shorten_mix"].spec.total_steps == 600
    # plain shorten: midtrain stays at its planned token position, past the new end -> cut
    assert by["shorten"].spec.data.phases == ()
    mix = by["shorten_mix"].spec
    assert int(mix.data.phases[0].start_frac * mix.total_steps) == 480  # 80% of 600
    assert plan.recommended == plan.options.index(by["shorten_mix"])


def test_past_the_first_quarter_shortening_needs_force():
    spec = proxy_spec(steps=1000)
    st = state_of(spec, upto=299)  # 30% of the budget
    due = st.now + 300.0
    short = next(o for o in make_replan(st, due, forecaster=None).options if o.kind == "shorten")
    assert not short.allowed and "--force" in short.note
    forced = next(o for o in make_replan(st, due, force=True, forecaster=None).options if o.kind == "shorten")
    assert forced.allowed and forced.spec.total_steps == 300 + 300


def test_drops_over_budget_offer_capacity_dropless_and_sequence_balancing_priced_in_memory():
    spec = proxy_spec(steps=1000, **{"model.dispatch": "capacity"})
    st = state_of(spec, upto=99, drop_frac_send=np.full(100, 0.05), drop_frac_recv=np.full(100, 0.05))
    opts = {o.kind: o for o in make_replan(st, forecaster=None).options}
    assert {"capacity", "dropless", "sequence_balance"} <= set(opts)
    cap = opts["capacity"].spec.model
    assert cap.capacity_factor_send > 1.25 and cap.capacity_factor_recv > 1.25
    assert opts["capacity"].allowed and opts["capacity"].memory_gb > 0
    assert opts["sequence_balance"].spec.model.balance_scope == "sequence"
    tiny_hbm = spec.replace(**{"hardware.hbm_gb": 1e-4})
    st = state_of(tiny_hbm, upto=99, drop_frac_send=np.full(100, 0.05), drop_frac_recv=np.full(100, 0.05))
    capped = next(o for o in make_replan(st, forecaster=None).options if o.kind == "capacity")
    assert not capped.allowed and "refused" in capped.note


def test_the_context_gate_follows_the_measured_drop_fraction():
    stages = [{"start_frac": 0.5, "seq_len": 128, "gated": True, "gate": "drop_frac <= 0.07"}]
    spec = proxy_spec(steps=1000, **{"data.context_stages": stages})
    ok = make_replan(state_of(spec, 99, drop_frac_send=np.full(100, 0.03)), forecaster=None)
    assert ok.context_gate["allowed"] and ok.context_gate["measured"] == pytest.approx(0.03)
    enable = next(o for o in ok.options if o.kind == "enable_context")
    assert enable.spec.data.context_stages[0].gated is False
    no = make_replan(state_of(spec, 99, drop_frac_send=np.full(100, 0.09)), forecaster=None)
    assert not no.context_gate["allowed"] and all(o.kind != "enable_context" for o in no.options)


def test_a_forecast_files_ladder_curve_model_is_matched_to_the_run_and_used_when_it_predicts_best(tmp_path):
    """The ladder's curve model (forecast.json's curve_model) knows the curve's shape; matched to the
    run's level it forecasts the final loss of a shortened horizon that the run's own 200 noisy
    points could only extrapolate."""
    from analysis.curves import fit as curves
    from analysis.monitor.watch import load_forecast
    from analysis.replan.run_forecaster import curve_forecaster

    spec = proxy_spec(steps=1000)
    lr_T = lr_at(spec, np.arange(1000))
    st = np.arange(10, 1000)
    rung = curves.fit_curves([curves.Curve.from_schedule(st, lr_T, 2.2 + 2.0 * (1 + st / 50.0) ** -0.5)], model="lra",
                             n_boot=4)
    steps = np.arange(200)
    run_truth = rung.predict(steps, lr_T) + 0.05  # this run sits 0.05 above the ladder's curve
    df = pd.DataFrame({"step": steps, "tokens": (steps + 1) * 512.0, "lr": lr_T[steps],
                       "loss": run_truth + 0.05 * np.random.default_rng(0).standard_normal(200)})
    doc = {"trajectory": {"step": [0, 999], "loss": [5, 2], "lo": [4, 1], "hi": [6, 3]},
           "hero": {"spec_id": spec.id}, "curve_model": rung.to_dict()}
    (tmp_path / "forecast.json").write_text(json.dumps(doc))
    state = RunState.build(df, spec, None, tokens_per_s=512.0, now=0.0, forecast=load_forecast(tmp_path / "forecast.json"))
    new = shorten_spec(spec, 200, 600, True, "shorten", "test")
    fc = curve_forecaster(state)(state, new, 200)
    truth = float(np.mean(rung.predict(np.arange(595, 600), lr_at(new, np.arange(600))))) + 0.05
    assert fc.model == "ladder" and set(fc.detail["holdout_err"]) == {"ladder", "mpl", "lra"}
    assert fc.lo <= truth <= fc.hi and fc.width < 0.15


def test_early_in_a_run_the_forecast_of_its_own_plan_anchors_the_level(tmp_path):
    """20% into a run, forecast.json's trajectory of this very plan (a narrow band) gives the
    level; the run's curve model only says how a shorter horizon moves it: down, by its earlier
    decay."""
    from analysis.monitor.watch import load_forecast
    from analysis.replan.run_forecaster import curve_forecaster

    spec = proxy_spec(steps=1000)
    steps = np.arange(1000)
    plan_curve = 2.3 + 3.0 * (1 + steps / 40.0) ** -0.6
    doc = {"trajectory": {"step": steps.tolist(), "loss": plan_curve.tolist(), "lo": (plan_curve - 0.03).tolist(),
                          "hi": (plan_curve + 0.03).tolist()},
           "hero": {"spec_id": spec.id, "final_loss": {"mean": float(plan_curve[-1]), "lo": 0, "hi": 9, "level": 0.9}}}
    (tmp_path / "forecast.json").write_text(json.dumps(doc))
    seen = np.arange(200)
    df = pd.DataFrame({"step": seen, "tokens": (seen + 1) * 512.0, "lr": lr_at(spec, seen),
                       "loss": plan_curve[seen] + 0.05 * np.random.default_rng(0).standard_normal(200)})
    state = RunState.build(df, spec, None, tokens_per_s=512.0, now=0.0, forecast=load_forecast(tmp_path / "forecast.json"))
    forecast = curve_forecaster(state)
    keep = forecast(state, spec, 200)
    assert keep.model.startswith("forecast+") and keep.detail["schedule_correction"] == 0.0
    assert keep.mean == pytest.approx(plan_curve[-5:].mean()) and keep.width < 0.1
    short = forecast(state, shorten_spec(spec, 200, 600, True, "shorten", "test"), 200)
    assert short.model.startswith("forecast+") and short.detail["schedule_correction"] < 0
    assert short.detail["anchor"] == pytest.approx(plan_curve[595:600].mean())


def test_a_finished_run_gets_no_options_and_says_so():
    spec = proxy_spec(steps=200)
    plan = make_replan(state_of(spec, upto=199), deadline=1.9e9 + 10.0, forecaster=None)
    assert plan.options == [] and plan.recommended is None
    assert "finished" in plan.recommendation and "no options" in plan.recommendation


def test_options_of_one_schedule_shape_forecast_no_higher_loss_for_more_tokens():
    """A forecaster that (wrongly) puts a shorter horizon lower than the plan: the replan pools the
    two so that more tokens never end higher, and says so."""
    spec = proxy_spec(steps=1000)
    st = state_of(spec, upto=99)

    def forecaster(state, option, resume_step):
        mean = 2.0 if option.total_steps < spec.total_steps else 3.0
        return OptionForecast(mean, mean - 0.1, mean + 0.1, 0.9, "planted")

    plan = make_replan(st, st.now + 300.0, forecaster=forecaster)
    by = {o.kind: o for o in plan.options}
    assert by["shorten"].spec.data.total_tokens < by["keep"].spec.data.total_tokens
    assert by["keep"].forecast.mean <= by["shorten"].forecast.mean
    assert any("monotone in tokens" in n for n in plan.notes)


def test_every_option_keeps_the_checkpoint_cadence_and_all_but_redraw_the_data_seed():
    spec = proxy_spec(steps=1000, **{"seed": 3, "model.dispatch": "capacity"})
    loss = 2.5 + 3 * np.exp(-np.arange(100) / 30.0)
    loss[90:] = np.nan  # a divergence: the rewind options too
    st = state_of(spec, upto=99, drop_frac_send=np.full(100, 0.05), drop_frac_recv=np.full(100, 0.05))
    st = RunState.build(st.df.assign(loss=loss), spec, None, tokens_per_s=512.0, now=1.9e9)
    plan = make_replan(st, st.now + 300.0, forecaster=None)
    kinds = {o.kind for o in plan.options if o.spec is not None}
    assert {"shorten", "capacity", "rewind_zloss", "rewind_redraw"} <= kinds
    for o in plan.options:
        if o.spec is None:
            continue
        assert o.spec.run.checkpoint_every == spec.run.checkpoint_every
        assert o.spec.seed == (spec.seed + 1 if o.kind == "rewind_redraw" else spec.seed)


# ---- lineage: the checkpoints of the runs a continuation continues ---------------------------


def _ledger_run(root: Path, spec, steps) -> Path:
    """A run dir in the ledger's layout with checkpoints at `steps` (tiny arrays: the lineage reads
    only which checkpoints exist and whose they are)."""
    from ladder import ledger

    d = ledger.run_dir_for(root, "px", spec)
    ledger.write_spec_file(d, spec)
    for step in steps:
        save_checkpoint(d, step, {"w": np.zeros(2)}, {"m/w": np.zeros(2), "v/w": np.zeros(2)},
                        {"spec_id": spec.id}, keep=10)
    return d


def test_a_continuation_finds_its_ancestors_checkpoints_through_the_ledger(tmp_path):
    """No kept checkpoint of the child records where it was seeded from (the seed checkpoint has
    rotated away): the ledger's parent_id leads to the parent, and on to the grandparent."""
    grand = proxy_spec("g")
    parent = derive(grand, "shorten", "r", 30, **{"data.total_tokens": grand.data.total_tokens // 2})
    child = derive(parent, "rewind_zloss", "r", 50, **{"optim.z_loss": 1e-4})
    g_dir = _ledger_run(tmp_path, grand, [10, 20, 30, 40])
    p_dir = _ledger_run(tmp_path, parent, [30, 40, 50, 60])
    c_dir = _ledger_run(tmp_path, child, [60, 70])
    assert ancestor_checkpoints(c_dir, child) == [(40, p_dir, parent.id), (30, p_dir, parent.id),
                                                  (20, g_dir, grand.id), (10, g_dir, grand.id)]
    assert ancestor_checkpoints(g_dir, grand) == []


def test_a_seed_checkpoint_from_a_run_the_lineage_does_not_name_is_not_followed(tmp_path):
    parent = proxy_spec("p")
    child = derive(parent, "rewind_zloss", "r", 20, **{"optim.z_loss": 1e-4})
    other = proxy_spec("q", **{"optim.peak_lr": 1e-3})
    assert other.id != parent.id
    o_dir = _ledger_run(tmp_path / "elsewhere", other, [10, 20])
    c_dir = tmp_path / "child"
    init_from_checkpoint(c_dir, o_dir / "checkpoints" / step_dir_name(20))
    assert ancestor_checkpoints(c_dir, child) == []
    assert ancestor_checkpoints(c_dir, derive(other, "rewind_zloss", "r", 20)) == [(10, o_dir, other.id)]
