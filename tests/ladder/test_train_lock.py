"""One `ladder train` at a time per run dir: a second one on the same run dir is refused in one
line naming the holder (exit 2) while the first trains on, and a SIGKILLed holder does not lock
the run dir out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.rundir import RunDir
from core.spec import load_spec, save_spec
from ladder.ledger import _lock_path
from ladder.worker import train_task
from tests.support import tiny_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _train(spec: Path, run_dir: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ladder.cli", "train", str(spec), "--run-dir", str(run_dir), "--quiet"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, **kw)


def _rows_past(run_dir: Path, n: int, proc: subprocess.Popen) -> int:
    deadline = time.monotonic() + 300  # only to catch a hang
    while time.monotonic() < deadline and proc.poll() is None:
        rows = len(RunDir(run_dir).read_metrics(warn=None))
        if rows > n:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"no metrics past {n} rows (exit {proc.poll()})")


def test_a_second_train_on_a_run_dir_is_refused_and_a_killed_holder_does_not_lock_it_out(tmp_path):
    spec = save_spec(tiny_spec("locked", steps=3000, checkpoint_every=5), tmp_path / "s.yaml")
    run_dir = tmp_path / "run"
    first = _train(spec, run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _rows_past(run_dir, 3, first)
        second = _train(spec, run_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 2, err[-3000:]
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and f"is being trained by another process" in lines[0] and f"pid {first.pid}" in lines[0], err
        assert first.poll() is None  # the holder trains on
    finally:
        first.kill()
        first.wait()
    rows = len(RunDir(run_dir).read_metrics(warn=None))
    third = _train(spec, run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _rows_past(run_dir, rows, third)  # it got past the dead holder's claim and trains
    finally:
        third.send_signal(signal.SIGKILL)
        third.wait()


def test_a_train_with_its_progress_bar_stops_when_another_process_takes_its_claim_over(tmp_path):
    spec_path = save_spec(tiny_spec("taken", steps=3000, checkpoint_every=5), tmp_path / "s.yaml")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ladder.cli", "train", str(spec_path), "--run-dir", str(run_dir)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _rows_past(run_dir, 3, proc)
        lock = _lock_path(run_dir, load_spec(spec_path).id)
        taken = {**json.loads(lock.read_text()), "owner": "another", "token": "0" * 16, "pid": 1}
        lock.write_text(json.dumps(taken))  # what a process that judged this one dead writes
        _, err = proc.communicate(timeout=300)  # the claim's heartbeat (5 s) sees it is lost
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "another process took this run dir over" in last and last.endswith("stopped"), err[-3000:]


def test_a_train_and_a_submissions_worker_on_one_run_dir_exclude_each_other(tmp_path):
    """`ladder train` runs the submission's worker (ladder.worker.run_claimed), whose claim lives
    in the run dir: while a `ladder train` trains, a submission's task on the same run dir is
    "busy" and trains nothing."""
    spec_obj = tiny_spec("shared", steps=3000, checkpoint_every=5)
    spec = save_spec(spec_obj, tmp_path / "s.yaml")
    run_dir = tmp_path / "run"
    first = _train(spec, run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _rows_past(run_dir, 3, first)
        out = train_task(spec_obj.model_dump_json(), str(run_dir), {"root": str(tmp_path / ".ladder"), "owner": "sub-1"})
        assert out["outcome"] == "busy" and out["holder"]["pid"] == first.pid, out
        assert first.poll() is None  # the holder trains on
    finally:
        first.kill()
        first.wait()
