"""Exact resume: a real `ladder train --engine jax` killed with SIGKILL mid-run and started
again ends with the same losses and bit-identical weights as a run that was never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engines.base import read_metrics, read_status
from engines.checkpoint import latest_checkpoint, load_checkpoint
from ladder.presets import micro_spec
from core.spec import save_spec

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# capacity dispatch and bias balancing: the buffers and the drop bookkeeping must resume too
SPEC = micro_spec(**{"model.dispatch": "capacity", "model.router_bias_balancing": True,
                     "run.checkpoint_every": 10, "run.eval_every": 20})


def _cmd(spec_path: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "ladder.cli", "train", str(spec_path), "--run-dir", str(run_dir),
            "--engine", "jax", "--quiet"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jax-resume")
    spec_path = save_spec(SPEC, tmp / "micro.yaml")
    # one compilation for the three processes (the same program, so the same numbers)
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp / "xla-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
    whole, killed = tmp / "whole", tmp / "killed"
    done = subprocess.run(_cmd(spec_path, whole), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(_cmd(spec_path, killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900  # a hang guard
    while time.time() < deadline and proc.poll() is None:
        if len(read_metrics(killed)) >= 35:  # past the step-30 checkpoint, before the end
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    cut = read_metrics(killed)
    status_at_kill = read_status(killed)

    again = subprocess.run(_cmd(spec_path, killed), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    return whole, killed, cut, status_at_kill


def test_the_kill_landed_mid_run(runs):
    _, _, cut, status_at_kill = runs
    assert 35 <= len(cut) < SPEC.total_steps
    assert status_at_kill["state"] == "running"


def test_resumed_metrics_equal_the_uninterrupted_run_step_for_step(runs):
    whole, killed, _, _ = runs
    a, b = read_metrics(whole), read_metrics(killed)
    assert [r["step"] for r in b] == list(range(SPEC.total_steps))  # no step twice, none missing
    for key in ("loss", "grad_norm", "drop_frac_send", "drop_frac_recv", "tokens", "eval_loss"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    assert read_status(killed)["state"] == "finished"


def test_resumed_weights_and_optimizer_state_are_bit_identical(runs):
    whole, killed, _, _ = runs
    pa, oa, sa = load_checkpoint(latest_checkpoint(whole))
    pb, ob, sb = load_checkpoint(latest_checkpoint(killed))
    assert sa["step"] == sb["step"] == SPEC.total_steps
    assert set(pa) == set(pb) and set(oa) == set(ob)
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k
    for k in oa:
        assert np.array_equal(oa[k], ob[k]), k
    assert np.any(pa["blocks.0.moe.router_bias"] != 0)  # the balancing buffers moved and resumed
