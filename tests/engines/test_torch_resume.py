"""Exact resume: a `ladder train` process killed with SIGKILL mid-run, resumed, ends bit-equal to
an uninterrupted run; a replan continues a parent's checkpoint."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engines.base import read_metrics, read_status
from engines.checkpoint import init_from_checkpoint, latest_checkpoint, load_checkpoint
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec
from core.spec import save_spec

LADDER = [sys.executable, "-m", "ladder.cli", "train"]
SPEC = micro_spec(**{"data.total_tokens": 64 * 8 * 80, "run.checkpoint_every": 20, "run.eval_every": 20})


def _train(spec_path: Path, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LADDER + [str(spec_path), "--run-dir", str(run_dir), "--quiet"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_equals_an_uninterrupted_run(tmp_path):
    spec_path = save_spec(SPEC, tmp_path / "micro.yaml")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = subprocess.Popen(LADDER + [str(spec_path), "--run-dir", str(killed), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    other = subprocess.Popen(LADDER + [str(spec_path), "--run-dir", str(whole), "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900  # a hang guard
    while time.time() < deadline:
        rows = read_metrics(killed)
        if rows and rows[-1]["step"] >= 47:  # past the checkpoint at 40: work after it is lost
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert read_status(killed)["state"] == "running"
    assert latest_checkpoint(killed).name == "step_00000040"
    _, err = other.communicate(timeout=300)
    assert other.returncode == 0, err

    resumed = _train(spec_path, killed)
    assert resumed.returncode == 0, resumed.stderr
    assert read_status(killed)["state"] == "finished"
    a, b = read_metrics(whole), read_metrics(killed)
    assert [r["step"] for r in b] == list(range(SPEC.total_steps))  # every step once
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["eval_loss"] for r in a] == [r["eval_loss"] for r in b]
    pa, oa, _ = load_checkpoint(latest_checkpoint(whole))
    pb, ob, _ = load_checkpoint(latest_checkpoint(killed))
    assert set(pa) == set(pb) and all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert all(np.array_equal(oa[k], ob[k]) for k in oa)


@pytest.mark.slow
def test_a_replan_continues_the_parents_checkpoint(tmp_path):
    parent = SPEC.replace(**{"data.total_tokens": 64 * 8 * 40})
    list(TorchEngine().train(parent, tmp_path / "parent"))
    child = parent.replace(**{
        "lineage.parent_id": parent.id, "lineage.resume_step": 20,
        "data.phases": [{"name": "docs", "start_frac": 0.5, "weights": {"docs": 1.0}}],
    })
    with pytest.raises(ValueError, match="has no checkpoint"):
        next(TorchEngine().train(child, tmp_path / "child"))
    init_from_checkpoint(tmp_path / "child", tmp_path / "parent" / "checkpoints" / "step_00000020",
                         metrics_from=tmp_path / "parent")
    recs = list(TorchEngine().train(child, tmp_path / "child"))
    assert recs[0].step == 20 and recs[-1].step == 39
    p_rows, c_rows = read_metrics(tmp_path / "parent"), read_metrics(tmp_path / "child")
    assert [r["step"] for r in c_rows] == list(range(40))
    assert [r["loss"] for r in c_rows[:20]] == [r["loss"] for r in p_rows[:20]]
    assert c_rows[20]["loss"] != p_rows[20]["loss"]  # from step 20 on the child reads only docs
