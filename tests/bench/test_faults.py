"""The fault suite at CPU scale: real runs of a tiny hero (healthy replicates and injected faults),
judged by the calibrated monitor as `compare --follow` would have judged them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.faults import FAULTS, run_suite, tiny_hero
from core.spec import save_spec

# what a 300-step run of a tiny model can show within 10% of its steps (a mixture switch moves its
# loss too slowly: docs/results/faults_cpu; a looped source and replayed tokens show as batches read twice)
SHOWN = ("lr_x4", "lr_x0.25", "no_warmup", "clip_off_lr_spike", "corrupted_batch", "router_collapse", "nan",
         "resume_wrong_step", "small_source_looped", "replayed_tokens")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The tiny suite once for the module: four healthy replicates and the faults it shows. The
    test's neighbours set its step rate: no run's throughput flags count (shared_machine)."""
    out = tmp_path_factory.mktemp("faults")
    res = run_suite(tiny_hero(), out, seeds=(1, 2, 3, 4), stop_frac=0.4, onset_frac=0.2, only=SHOWN,
                    log=lambda *_: None, shared_machine=True)
    return out, res


@pytest.mark.slow
def test_healthy_replicates_stay_quiet_and_the_faults_a_tiny_run_shows_are_caught_in_time(suite):
    tmp_path, res = suite
    rows = {r["run"]: r for r in res["rows"]}
    healthy = [r for r in res["rows"] if r["role"] == "healthy"]
    assert len(healthy) == 4
    for r in healthy:  # judged against a calibration from the other three
        assert r["first_flag_step"] is None, (r["run"], [f for f in r["flags"] if f["severity"] != "info"])
    for name in SHOWN:
        r = rows[name]
        assert r["pass"], (name, r["first_flag_step"], r.get("first_flag"), r.get("first_critical_step"))
    assert rows["nan"]["first_critical"] == "non_finite"
    assert rows["replayed_tokens"]["first_critical"] == "repeated_batch"
    written = json.loads((tmp_path / "faults.json").read_text())
    assert [r["run"] for r in written["rows"]] == [r["run"] for r in res["rows"]]
    assert "| nan |" in (tmp_path / "faults.md").read_text()
    assert (tmp_path / "calibration.json").exists()
    # judged again on the same runs (a changed monitor): nothing is trained again
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    again = run_suite(tiny_hero(), tmp_path, seeds=(1, 2, 3, 4), stop_frac=0.4, onset_frac=0.2, only=("nan",),
                      log=lambda *_: None, reuse=True, shared_machine=True)
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert next(r for r in again["rows"] if r["run"] == "nan")["pass"]


def test_the_suite_names_an_unknown_fault(tmp_path):
    with pytest.raises(ValueError, match="unknown fault"):
        run_suite(tiny_hero(), tmp_path, seeds=(1, 2), stop_frac=0.02, onset_frac=0.01, only=("no_such_fault",),
                  log=lambda *_: None)


def test_a_shared_machine_refuses_the_fault_only_the_step_rate_shows(tmp_path):
    with pytest.raises(ValueError, match="throughput_drop is flagged by the step rate"):
        run_suite(tiny_hero(), tmp_path, seeds=(1, 2), stop_frac=0.02, onset_frac=0.01, shared_machine=True,
                  log=lambda *_: None)
    assert not (tmp_path / "runs").exists()  # refused before anything trained


def test_every_fault_is_a_spec_change_or_a_hook():
    assert all(f.spec_change or f.hook for f in FAULTS)
    assert len({f.name for f in FAULTS}) == len(FAULTS)


@pytest.mark.slow
def test_faults_train_in_parallel_beside_healthy_runs_trained_elsewhere(suite, tmp_path):
    """--healthy-runs: runs trained elsewhere (here the module suite's replicates, trained as far as
    the faults train) calibrate and are judged, nothing is trained for them; --jobs: the faults
    train in subprocesses, their rate flags not counted."""
    first_out, first = suite
    dirs = tuple(first_out / "runs" / f"healthy_seed{s}" for s in (1, 2, 3))
    assert [r["state"] for r in first["rows"] if r["run"] in {d.name for d in dirs}] == ["stopped"] * 3
    res = run_suite(tiny_hero(), tmp_path / "b", stop_frac=0.4, onset_frac=0.2, only=("nan", "lr_x4"),
                    healthy_runs=dirs, jobs=2, hero_args=["--tiny"], log=lambda *_: None)
    assert not (tmp_path / "b" / "runs" / "healthy_seed1").exists()
    rows = {r["run"]: r for r in res["rows"]}
    assert {r["run"] for r in res["rows"] if r["role"] == "healthy"} == {"healthy_seed1", "healthy_seed2",
                                                                         "healthy_seed3"}
    for name in ("nan", "lr_x4"):
        assert rows[name]["shared_device"] and rows[name]["pass"], rows[name]
        assert (tmp_path / "b" / "logs" / f"{name}.log").exists()
    assert res["shared_device"] == ["lr_x4", "nan"]


def test_healthy_runs_of_another_spec_are_refused(tmp_path):
    other = tiny_hero().replace(**{"optim.peak_lr": 0.5})
    d = tmp_path / "other"
    d.mkdir()
    save_spec(other, d / "spec.yaml")
    with pytest.raises(ValueError, match="not a replicate"):
        run_suite(tiny_hero(), tmp_path / "b", healthy_runs=(d,), log=lambda *_: None)


def test_the_clip_off_fault_trains_clipped_until_its_onset_and_unclipped_after(tmp_path):
    """The clip-off fault is one departure at its onset: before it the run is the healthy hero
    (clipped), from it the step module's spec has clipping off and the LR is x30 for 5 steps."""
    hero = tiny_hero()
    fault = next(f for f in FAULTS if f.name == "clip_off_lr_spike")
    assert fault.spec_change is None
    module = SimpleNamespace(spec=hero)  # the step module the suite hands the Trainer and the hook
    hook = fault.hook(hero, 10, module, None)
    assert hook.pre_step(9, "batch", 1.0) == ("batch", 1.0)
    assert module.spec.optim.grad_clip == hero.optim.grad_clip
    assert hook.pre_step(10, "batch", 1.0) == ("batch", 30.0)
    assert module.spec.optim.grad_clip == 1e6
    assert hook.pre_step(15, "batch", 1.0) == ("batch", 1.0)
