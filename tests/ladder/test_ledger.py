"""The ledger on disk (run dirs, states, the DataFrame view) and the per-spec claims."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.base import MetricsWriter, StepMetrics, write_status
from ladder import ledger
from tests.support import tiny_spec

HOLD_CLAIM = """
import sys, time
from ladder.ledger import Claim
c = Claim.acquire(sys.argv[1], sys.argv[2], sys.argv[3])
print("got" if c is not None else "busy", flush=True)
time.sleep(float(sys.argv[4]))
"""


def _records(run_dir: Path, steps: range) -> None:
    w = MetricsWriter(run_dir, steps.start)
    for s in steps:
        w.write(StepMetrics(step=s, tokens=128 * (s + 1), loss=5.0 - 0.01 * s, grad_norm=1.0, lr=1e-3, tokens_per_s=1000.0))
    w.close()


def test_run_dir_is_root_runs_experiment_name_dash_id(tmp_path):
    spec = tiny_spec("r1")
    assert ledger.run_dir_for(tmp_path, "exp", spec) == tmp_path / "runs" / "exp" / f"r1-{spec.id}"


def test_root_comes_from_argument_then_env_then_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOE_LADDER_ROOT", raising=False)
    assert ledger.ladder_root() == tmp_path / ".ladder"
    monkeypatch.setenv("MOE_LADDER_ROOT", str(tmp_path / "env"))
    assert ledger.ladder_root() == tmp_path / "env"
    assert ledger.ladder_root(tmp_path / "arg") == tmp_path / "arg"


def test_finished_needs_status_and_the_final_step(tmp_path):
    spec = tiny_spec("r1", steps=5)
    d = tmp_path / "run"
    _records(d, range(0, 4))
    write_status(d, "finished")
    assert not ledger.is_finished(d, spec)  # the last step's record is missing
    _records(d, range(4, 5))
    assert ledger.is_finished(d, spec)
    write_status(d, "running")
    assert not ledger.is_finished(d, spec)


def test_last_metrics_skips_a_torn_final_line(tmp_path):
    _records(tmp_path, range(0, 3))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')
    assert ledger.last_metrics(tmp_path)["step"] == 2


def test_runs_frame_has_one_row_per_spec_with_its_state(tmp_path, write_experiment):
    from ladder.experiment import load_experiment

    path = write_experiment("exp", [("a", {}), ("b", {"seed": 1}), ("c", {"seed": 2}), ("d", {"seed": 3})], steps=5)
    exp = load_experiment(path)
    root = tmp_path / ".ladder"
    a, b, c, d = exp.rungs
    for spec in (a, b, c):
        ledger.write_spec_file(ledger.run_dir_for(root, "exp", spec), spec)
    _records(ledger.run_dir_for(root, "exp", a), range(5))
    write_status(ledger.run_dir_for(root, "exp", a), "finished")
    _records(ledger.run_dir_for(root, "exp", b), range(3))
    write_status(ledger.run_dir_for(root, "exp", b), "running")  # nobody holds it: a dead worker's
    write_status(ledger.run_dir_for(root, "exp", c), "diverged")

    frame = ledger.runs_frame(root, path)
    assert list(frame["name"]) == ["a", "b", "c", "d"]
    assert dict(zip(frame["name"], frame["state"])) == {"a": "finished", "b": "failed", "c": "diverged", "d": "pending"}
    row_b = frame.set_index("name").loc["b"]
    assert row_b["step"] == 2 and row_b["total_steps"] == 5 and "interrupted" in row_b["detail"]
    assert frame.set_index("name").loc["a", "loss"] == pytest.approx(5.0 - 0.04)
    # without the experiment file: the run dirs alone (no pending row for d)
    assert sorted(ledger.runs_frame(root)["name"]) == ["a", "b", "c"]
    assert sorted(ledger.runs_frame(root, "exp")["name"]) == ["a", "b", "c"]


def test_a_claim_is_exclusive_until_released(tmp_path):
    first = ledger.Claim.acquire(tmp_path, "abc", owner="sub-1")
    assert first is not None
    assert ledger.Claim.acquire(tmp_path, "abc", owner="sub-2") is None
    assert ledger.live_claim(tmp_path, "abc")["owner"] == "sub-1"
    first.release()
    assert ledger.live_claim(tmp_path, "abc") is None
    again = ledger.Claim.acquire(tmp_path, "abc", owner="sub-2")
    assert again is not None
    again.release()


def test_a_claim_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", HOLD_CLAIM, str(tmp_path), "abc", "sub-1", "60"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "got"
    assert ledger.Claim.acquire(tmp_path, "abc", owner="sub-2") is None  # the holder is alive
    p.send_signal(signal.SIGKILL)
    p.wait()
    c = ledger.Claim.acquire(tmp_path, "abc", owner="sub-2")
    assert c is not None and c.info["owner"] == "sub-2"
    c.release()


def test_a_claim_without_heartbeat_goes_stale(tmp_path, monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", HOLD_CLAIM, str(tmp_path), "abc", "sub-1", "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "got"
        lock = tmp_path / "locks" / "abc.lock"
        # a holder elsewhere (we cannot see its pid) whose heartbeat stopped 10 minutes ago
        info = json.loads(lock.read_text())
        info["host"] = "another-host"
        lock.write_text(json.dumps(info))
        os.utime(lock, (time.time() - 600, time.time() - 600))
        monkeypatch.setenv("MOE_LADDER_LIMITS", "claim_stale_s=120")
        c = ledger.Claim.acquire(tmp_path, "abc", owner="sub-2")
        assert c is not None
        c.release()
    finally:
        p.kill()
        p.wait()


def test_a_fresh_heartbeat_from_another_host_keeps_the_claim(tmp_path):
    holder = ledger.Claim.acquire(tmp_path, "abc", owner="sub-1")
    info = json.loads(holder.path.read_text())
    info["host"] = "another-host"
    holder.path.write_text(json.dumps(info))
    assert ledger.Claim.acquire(tmp_path, "abc", owner="sub-2") is None
    holder.release()


def test_a_submission_takes_over_its_own_claim_and_the_old_holder_stops(tmp_path):
    """Ray retries a task only after its previous attempt died; the retry must not wait for it,
    and an old attempt that is somehow still alive learns that it lost the spec."""
    old = ledger.Claim.acquire(tmp_path, "abc", owner="sub-1", heartbeat_s=0.05)
    new = ledger.Claim.acquire(tmp_path, "abc", owner="sub-1")
    assert new is not None and new.token != old.token
    deadline = time.time() + 120  # a hang guard: the heartbeat is 0.05 s
    while not old.lost and time.time() < deadline:
        time.sleep(0.02)
    assert old.lost
    old.release()
    assert ledger.live_claim(tmp_path, "abc")["token"] == new.token
    new.release()


def test_a_holder_whose_claim_was_taken_over_notices(tmp_path):
    holder = ledger.Claim(tmp_path / "x.lock", {"token": "t1"}, heartbeat_s=0.05)
    (tmp_path / "x.lock").write_text(json.dumps({"token": "t2"}))
    deadline = time.time() + 120  # a hang guard: the heartbeat is 0.05 s
    while not holder.lost and time.time() < deadline:
        time.sleep(0.02)
    assert holder.lost
    holder.release()
    assert (tmp_path / "x.lock").exists()  # release never removes somebody else's claim


def test_racing_processes_claim_a_spec_exactly_once(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", HOLD_CLAIM, str(tmp_path), "abc", f"sub-{i}", "3"], stdout=subprocess.PIPE, text=True)
        for i in range(6)
    ]
    answers = [p.stdout.readline().strip() for p in procs]
    for p in procs:
        p.kill()
        p.wait()
    assert sorted(answers) == ["busy"] * 5 + ["got"]


@pytest.mark.parametrize("parts", [("..", "x"), ("a/../../b",), ("",), (".",), ("a/b",), ("..",)])
def test_a_path_the_ledger_builds_never_leaves_its_root(tmp_path, parts):
    from ladder.errors import LadderError

    with pytest.raises(LadderError, match="does not stay inside"):
        ledger.inside(tmp_path, *parts)


def test_an_experiment_name_that_would_escape_the_ledger_is_refused_where_the_experiment_is_made():
    from core.spec import SpecError
    from ladder.experiment import Experiment
    from ladder.presets import micro_spec

    with pytest.raises(SpecError, match="not a safe name"):
        Experiment(name="../../escape", rungs=(micro_spec("a"),))
    with pytest.raises(ValueError, match="not a safe name"):
        micro_spec("../a")
