"""The fault suite at CPU scale: real runs of a tiny hero (healthy replicates and injected faults),
judged by the calibrated monitor as `compare --follow` would have judged them."""

from __future__ import annotations

import json

import pytest

from bench.faults import FAULTS, run_suite, tiny_hero

# what a 300-step run of a tiny model can show within 10% of its steps (the data faults, a
# mixture switch, a looped source and replayed tokens, move its loss too slowly: docs/results/faults_cpu)
SHOWN = ("lr_x4", "lr_x0.25", "no_warmup", "clip_off_lr_spike", "corrupted_batch", "router_collapse", "nan",
         "resume_wrong_step")


@pytest.mark.slow
def test_healthy_replicates_stay_quiet_and_the_faults_a_tiny_run_shows_are_caught_in_time(tmp_path):
    res = run_suite(tiny_hero(), tmp_path, seeds=(1, 2, 3, 4), stop_frac=0.4, onset_frac=0.2, only=SHOWN,
                    log=lambda *_: None)
    rows = {r["run"]: r for r in res["rows"]}
    healthy = [r for r in res["rows"] if r["role"] == "healthy"]
    assert len(healthy) == 4
    for r in healthy:  # judged against a calibration from the other three
        assert r["first_flag_step"] is None, (r["run"], [f for f in r["flags"] if f["severity"] != "info"])
    for name in SHOWN:
        r = rows[name]
        assert r["pass"], (name, r["first_flag_step"], r.get("first_flag"), r.get("first_critical_step"))
    assert rows["nan"]["first_critical"] == "non_finite"
    written = json.loads((tmp_path / "faults.json").read_text())
    assert [r["run"] for r in written["rows"]] == [r["run"] for r in res["rows"]]
    assert "| nan |" in (tmp_path / "faults.md").read_text()
    assert (tmp_path / "calibration.json").exists()
    # judged again on the same runs (a changed monitor): nothing is trained again
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs").glob("*/metrics.jsonl")}
    again = run_suite(tiny_hero(), tmp_path, seeds=(1, 2, 3, 4), stop_frac=0.4, onset_frac=0.2, only=("nan",),
                      log=lambda *_: None, reuse=True)
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert next(r for r in again["rows"] if r["run"] == "nan")["pass"]


def test_the_suite_names_an_unknown_fault(tmp_path):
    with pytest.raises(ValueError, match="unknown fault"):
        run_suite(tiny_hero(), tmp_path, seeds=(1, 2), stop_frac=0.02, onset_frac=0.01, only=("no_such_fault",),
                  log=lambda *_: None)


def test_every_fault_is_a_spec_change_or_a_hook():
    assert all(f.spec_change or f.hook for f in FAULTS)
    assert len({f.name for f in FAULTS}) == len(FAULTS)
