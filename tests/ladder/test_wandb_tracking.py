"""Our own runs uploaded to W&B beside MLflow (`ladder sync --tracker wandb`), with the real wandb
library in offline mode, read back through the W&B reader."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("wandb")

from analysis.runs.metrics import read_metrics_frame  # noqa: E402
from analysis.runs.sources import open_source  # noqa: E402
from core.rundir import iter_run_dirs  # noqa: E402
from tests import cli_fork  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def ladder_root(tmp_path):
    """A ladder root with one real rung of the committed H200 ladder, its metrics cut to 300 steps."""
    src = tmp_path / "x"
    with tarfile.open(REPO / "docs" / "results" / "h200_ladder" / "h200_ladder.tar.gz") as tar:
        tar.extractall(src, filter="data")
    rd = next(r for r in iter_run_dirs(src) if r.path.name.startswith("d192"))
    dest = tmp_path / "root" / "runs" / "proxy_h200" / rd.path.name
    dest.mkdir(parents=True)
    shutil.copy(rd.spec_path, dest / "spec.yaml")
    lines = rd.metrics_path.read_text().splitlines()
    (dest / "metrics.jsonl").write_text("\n".join(lines[:300]) + "\n")
    (dest / "rest.jsonl").write_text("\n".join(lines[300:400]) + "\n")
    return tmp_path / "root", dest


def sync(root: Path) -> subprocess.CompletedProcess:
    return cli_fork.ladder("sync", "--root", root, "--tracker", "wandb", cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true", "COLUMNS": "300"})


def test_a_synced_run_reads_back_from_wandb_as_its_run_dir_and_a_later_sync_sends_only_new_steps(ladder_root):
    root, run_dir = ladder_root
    out = sync(root)
    assert out.returncode == 0, out.stderr
    first = next(root.joinpath("wandb", "wandb").glob("offline-run-*"))
    got = open_source(f"wandb:{first}").read()
    want = read_metrics_frame(run_dir / "metrics.jsonl")
    assert list(got["step"]) == list(want["step"])
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-12)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-12)
    # the run goes on: a second sync sends the 100 new steps only
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write((run_dir / "rest.jsonl").read_text())
    again = sync(root)
    assert again.returncode == 0, again.stderr
    runs = sorted(root.joinpath("wandb", "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    more = open_source(f"wandb:{runs[-1]}").read()
    assert list(more["step"]) == list(range(300, 400))
    assert open_source(f"wandb:{runs[-1]}").read().shape[0] == 100


@pytest.mark.slow
def test_submit_with_the_wandb_tracker_uploads_each_run_when_the_submission_ends(tmp_path, write_experiment):
    exp = write_experiment("wb", [("a", {})], steps=20)
    root = tmp_path / ".ladder"
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(exp), "--local", "--root", str(root),
                          "--tracker", "wandb"], capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr
    assert "W&B: 20 new steps of 1 runs" in out.stdout
    assert not (root / "mlflow.db").exists()  # wandb alone: no MLflow store
    run = next(root.joinpath("wandb", "wandb").glob("offline-run-*"))
    src = open_source(f"wandb:{run}")
    assert list(src.read()["step"]) == list(range(20)) and src.status()["state"] == "finished"
