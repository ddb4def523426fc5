"""`ladder submit` on a fresh local Ray hands an expert-parallel spec to a Ray worker, whose
torch engine trains it in model.ep_size ranks (forced onto gloo CPU processes here, as GPUs
would choose them): every step once in metrics.jsonl and in MLflow, and the ranks' layout file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engines.base import read_metrics
from ladder import ledger, tracking
from ladder.experiment import load_experiment

pytestmark = pytest.mark.slow


def test_a_submitted_ep_spec_trains_in_its_ranks(write_experiment, tmp_path):
    path = write_experiment("ep_sweep", [("ranks", {"model.ep_size": 2, "model.dispatch": "capacity"})],
                            steps=8, checkpoint_every=4)
    root = tmp_path / ".ladder"
    env = {**os.environ, "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1",
           "MOE_LADDER_OPTIONS": "torch_ep=processes,cpu_threads=1"}
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(root)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    spec = load_experiment(path).rungs[0]
    run_dir = ledger.run_dir_for(root, "ep_sweep", spec)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(spec.total_steps))
    layout = json.loads((run_dir / "mesh.json").read_text())
    assert layout["world_size"] == 2 and [r["experts"] for r in layout["ranks"]] == [[0, 4], [4, 8]]
    assert list(ledger.runs_frame(root, path)["state"]) == ["finished"]
    uri = tracking.default_tracking_uri(root)
    (run,) = [r for r in tracking.child_runs(uri, "ep_sweep") if r.data.tags["spec_id"] == spec.id]
    logged = tracking.iter_metric_points(uri, run.info.run_id, ["loss"])
    assert sorted(logged["loss"]) == list(range(spec.total_steps))
