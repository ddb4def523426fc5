"""A disk that fills up while `ladder train` appends metrics: the error names metrics.jsonl (one
line, exit 2), status.json says "failed" (rewritten in place where a new file finds no room), and
metrics.jsonl ends with its last whole record.

The disk is a 4 MiB tmpfs in a mount namespace of the command's own (`unshare -m` as root, a user
namespace otherwise), filled by another process (dd) as soon as the run has written its first record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import tiny_spec

REPO = Path(__file__).resolve().parents[2]

FILL = """
mount -t tmpfs -o size=4m tmpfs "$MNT" || exit 90
"$@" > "$OUT/stdout" 2> "$OUT/stderr" &
pid=$!
i=0
while [ ! -s "$MNT/run/metrics.jsonl" ] && [ $i -lt 6000 ] && kill -0 $pid 2>/dev/null; do sleep 0.05; i=$((i+1)); done
dd if=/dev/zero of="$MNT/filler" bs=4096 2>/dev/null
wait $pid
echo $? > "$OUT/rc"
cp -a "$MNT/run" "$OUT/run"
"""


def _unshare() -> list[str] | None:
    """The unshare that gives this test a private mount namespace here, if any does."""
    for argv in (["unshare", "-m"] if os.geteuid() == 0 else [], ["unshare", "-rm"]):
        if argv and subprocess.run([*argv, "true"], capture_output=True).returncode == 0:
            return argv
    return None


@pytest.mark.slow
def test_a_disk_full_while_appending_metrics_names_the_file_and_marks_the_run_failed(tmp_path):
    unshare = _unshare()
    if unshare is None:
        pytest.skip("no private mount namespace here (unshare -m needs root, unshare -rm user namespaces)")
    spec = tiny_spec("full", steps=5000, checkpoint_every=10**6)  # a checkpoint at step 0 only, then records
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(spec.to_yaml())
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    train = [sys.executable, "-m", "ladder.cli", "train", str(spec_path), "--run-dir", str(mnt / "run"), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MNT": str(mnt), "OUT": str(out), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*unshare, "sh", "-c", FILL, "fill", *train], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and (out / "rc").exists(), done.stderr
    run = mnt / "run"  # (as the command saw it; the files themselves were copied to out/run)
    err = (out / "stderr").read_text().strip().splitlines()
    assert (out / "rc").read_text().strip() == "2", err
    assert err == [f"error: {run / 'metrics.jsonl'}: No space left on device"]
    status = json.loads((out / "run" / "status.json").read_text())
    assert status["state"] == "failed" and str(run / "metrics.jsonl") in status["error"]
    raw = (out / "run" / "metrics.jsonl").read_bytes()
    assert raw.endswith(b"\n")  # no torn record
    steps = [json.loads(line)["step"] for line in raw.splitlines()]
    assert steps == list(range(len(steps))) and 0 < len(steps) < spec.total_steps
