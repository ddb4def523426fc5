"""A read-only ladder root, met by real `ladder submit` processes: refused before anything trains
(and before Ray starts), in one line naming the path, exit 2; no MLflow traceback, no Ray task error.

Read-only is a read-only bind mount in a mount namespace of the command's own when the tests run as
root (root writes through file permissions), and the write permission taken away otherwise."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ladder import ledger
from ladder.experiment import load_experiment

REPO = Path(__file__).resolve().parents[2]


def submit_read_only(tmp: Path, exp: Path, root: Path, *flags: str, writable: tuple[Path, ...] = (),
                     command: str = "submit") -> subprocess.CompletedProcess:
    """`ladder submit exp --root root flags` (or another command) with `root` read-only but for the
    directories `writable` under it."""
    argv = [sys.executable, "-m", "ladder.cli", command, str(exp), "--root", str(root), *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if os.geteuid() == 0:
        q = shlex.quote
        mounts = [f"mount --bind {q(str(root))} {q(str(root))}"]
        mounts += [f"mount --bind {q(str(w))} {q(str(w))}" for w in writable]  # before the remount: they stay writable
        mounts.append(f"mount -o remount,bind,ro {q(str(root))}")
        script = " && ".join(mounts) + " && exec " + shlex.join(argv)
        return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env,
                              cwd=tmp, timeout=600)
    keep = {w.resolve() for w in writable}
    changed = []
    for p in [root, *root.rglob("*")]:
        if not any(p.resolve() == w or w in p.resolve().parents for w in keep):
            changed.append((p, p.stat().st_mode))
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
    finally:
        for p, mode in reversed(changed):
            p.chmod(mode)


def test_a_read_only_mlflow_store_is_refused_before_training_in_one_line(tmp_path, seeded_root, write_experiment):
    exp = write_experiment("ro", [("a", {})], steps=10, checkpoint_every=5)
    for d in ("runs", "locks"):  # the runs could be written, the store beside them cannot
        (seeded_root / d).mkdir()
    r = submit_read_only(tmp_path, exp, seeded_root, "--local", writable=(seeded_root / "runs", seeded_root / "locks"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert f"{seeded_root / 'mlflow.db'}:" in lines[0] and "--no-tracking" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    run_dir = ledger.run_dir_for(seeded_root, "ro", load_experiment(exp).rungs[0])
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained


def test_a_read_only_run_dir_is_refused_before_ray_starts_in_one_line(tmp_path, write_experiment):
    exp = write_experiment("ro", [("a", {})], steps=10, checkpoint_every=5)
    root = tmp_path / "root"
    run_dir = ledger.run_dir_for(root, "ro", load_experiment(exp).rungs[0])
    run_dir.mkdir(parents=True)
    ledger.write_spec_file(run_dir, load_experiment(exp).rungs[0])  # a run that has yet to train
    r = submit_read_only(tmp_path, exp, root, "--no-tracking")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"error: {run_dir}:") and "RayTaskError" not in r.stderr + r.stdout


@pytest.mark.slow
def test_sync_to_a_read_only_mlflow_store_is_refused_in_one_line(tmp_path, seeded_root, write_experiment):
    exp = write_experiment("ro", [("a", {})], steps=10, checkpoint_every=5)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    tracked = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(exp), "--root", str(seeded_root), "--local"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert tracked.returncode == 0, tracked.stderr[-3000:]  # a run MLflow holds
    r = submit_read_only(tmp_path, exp, seeded_root, command="sync")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:] + r.stdout[-3000:]
    assert f"{seeded_root / 'mlflow.db'}:" in lines[0] and "cannot be written" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
