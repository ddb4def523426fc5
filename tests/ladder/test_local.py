"""`ladder submit --local`: runs one after another in subprocesses, no Ray; same ledger, claims,
resume and MLflow mirror as the Ray controller."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from core.rundir import RunDir
from ladder import ledger, tracking
from ladder.controller import submit
from ladder.errors import LadderError
from ladder.experiment import load_experiment
from tests.support import tiny_changes

pytestmark = pytest.mark.slow

STEPS = 40


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


def _experiment(tmp: Path, name: str = "loc", rungs=(("a", {}), ("b", {"seed": 1})), **extra) -> Path:
    path = tmp / f"{name}.py"
    path.write_text(
        "from ladder.experiment import Experiment\nfrom ladder.presets import micro_spec\n"
        f"BASE = {tiny_changes(STEPS, 10, **extra)!r}\n"
        f"EXPERIMENT = Experiment(name={name!r}, rungs=tuple(micro_spec(n, **{{**BASE, **c}}) for n, c in {list(rungs)!r}))\n"
    )
    return path


def test_local_submit_trains_every_spec_and_mirrors_it_to_mlflow(tmp_path, seeded_root):
    path = _experiment(tmp_path)
    result = submit(path, root=seeded_root, console=_quiet(), local=True)
    assert result.ok and sorted(o["outcome"] for o in result.outcomes.values()) == ["finished", "finished"]
    uri = tracking.default_tracking_uri(seeded_root)
    for spec in load_experiment(path).rungs:
        d = ledger.run_dir_for(seeded_root, "loc", spec)
        assert [r["step"] for r in RunDir(d).read_metrics()] == list(range(STEPS))
        runs = [r for r in tracking.child_runs(uri, "loc") if r.data.tags["spec_id"] == spec.id]
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        assert sorted(tracking.iter_metric_points(uri, runs[0].info.run_id, ["loss"])["loss"]) == list(range(STEPS))


def test_local_submit_skips_finished_runs(tmp_path, seeded_root):
    path = _experiment(tmp_path, rungs=(("a", {}),))
    submit(path, root=seeded_root, console=_quiet(), local=True, tracking=False)
    again = submit(path, root=seeded_root, console=_quiet(), local=True, tracking=False)
    assert again.outcomes == {} and [p.action for p in again.planned] == ["skip-finished"]


def test_a_killed_local_worker_resumes_to_the_same_losses(tmp_path):
    """SIGKILL the worker mid-run: the next --local submission resumes from the checkpoint and
    ends with every step once and the losses of an uninterrupted run."""
    path = _experiment(tmp_path, rungs=(("a", {}),))
    spec = load_experiment(path).rungs[0]
    clean_root, root = tmp_path / "clean", tmp_path / "killed"
    submit(path, root=clean_root, console=_quiet(), local=True, tracking=False)
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    drv = subprocess.Popen([sys.executable, "-m", "ladder.cli", "submit", str(path), "--local", "--no-tracking",
                            "--root", str(root)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = ledger.run_dir_for(root, "loc", spec)
    deadline = time.time() + 300  # a hang guard
    while time.time() < deadline and not list((d / "checkpoints").glob("*")):
        time.sleep(0.1)
    worker = ledger.live_claim(d, spec.id)
    assert worker is not None, "the worker holds a claim while it trains"
    os.kill(int(worker["pid"]), signal.SIGKILL)
    drv.wait(timeout=300)
    assert drv.returncode != 0
    result = submit(path, root=root, console=_quiet(), local=True, tracking=False)
    assert result.ok
    got = RunDir(d).read_metrics()
    want = RunDir(ledger.run_dir_for(clean_root, "loc", spec)).read_metrics()
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_local_submit_refuses_a_spec_this_machine_cannot_run(tmp_path):
    path = _experiment(tmp_path, rungs=(("a", {"hardware.task_gpus": 64}),))
    with pytest.raises(LadderError, match="asks for 64 GPU per run; this machine has"):
        submit(path, root=tmp_path / "r", console=_quiet(), local=True, tracking=False)


# what a --local run leaves in its run dir (a worker that could not hand its outcome to its driver
# used to leave a .outcome.*.json beside them)
RUN_FILES = {"spec.yaml", "metrics.jsonl", "status.json", "checkpoints", "attempts.jsonl", "worker.log", "locks"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_local_driver_takes_its_worker_with_it(tmp_path):
    """SIGKILL the driver mid-run: its worker stops (no more metrics rows), releases its claim, marks
    the run interrupted and leaves nothing in the run dir but the run's own files."""
    path = _experiment(tmp_path, rungs=(("a", {}),), **{"data.total_tokens": 64 * 8 * 2000})  # far from done
    spec = load_experiment(path).rungs[0]
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    drv = subprocess.Popen([sys.executable, "-m", "ladder.cli", "submit", str(path), "--local", "--no-tracking",
                            "--root", str(root)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    d = ledger.run_dir_for(root, "loc", spec)
    deadline, worker = time.time() + 300, None  # only to catch a hang
    while time.time() < deadline and (worker is None or len(RunDir(d).read_metrics()) < 5) and drv.poll() is None:
        worker = ledger.live_claim(d, spec.id)
        time.sleep(0.1)
    assert worker is not None, (d / "worker.log").read_text()[-3000:] if (d / "worker.log").exists() else drv.communicate()[1]
    pid = int(worker["pid"])
    drv.kill()
    drv.wait(timeout=300)
    deadline = time.time() + 300  # only to catch a worker that never stops
    while time.time() < deadline and not _gone(pid):
        time.sleep(0.1)
    try:
        assert _gone(pid), "the worker outlived its driver"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
    rows = len(RunDir(d).read_metrics())
    time.sleep(2)
    assert len(RunDir(d).read_metrics()) == rows < spec.total_steps
    assert ledger.live_claim(d, spec.id) is None
    status = RunDir(d).read_status()
    assert (status["state"], status["reason"]) == ("failed", "interrupted")
    assert {f.name for f in d.iterdir()} <= RUN_FILES, (d / "worker.log").read_text()[-3000:]


def test_a_resumed_local_run_says_the_step_it_resumes_from(tmp_path):
    """After a SIGKILLed worker, the next --local submission prints "from step N" with the step
    of the checkpoint it resumes from, not the first metrics record it happens to see."""
    from engines.checkpoint import resume_step

    path = _experiment(tmp_path, rungs=(("a", {}),))
    spec = load_experiment(path).rungs[0]
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    argv = [sys.executable, "-m", "ladder.cli", "submit", str(path), "--local", "--no-tracking", "--root", str(root)]
    drv = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = ledger.run_dir_for(root, "loc", spec)
    deadline = time.time() + 300  # only to catch a hang
    while time.time() < deadline and len(RunDir(d).read_metrics()) < 15 and drv.poll() is None:
        time.sleep(0.05)
    worker = ledger.live_claim(d, spec.id)
    assert worker is not None
    os.kill(int(worker["pid"]), signal.SIGKILL)
    drv.wait(timeout=300)
    start = resume_step(d)
    # a checkpoint past the first record; the kill may land right after it (start == records)
    assert 0 < start <= len(RunDir(d).read_metrics())
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"from step {start}" in again.stderr, again.stderr[-3000:]
