"""Watching a run this project did not launch: an OLMo-core-named run logged by a plain MLflow
script (no ladder code) to a real `mlflow server` on 127.0.0.1, read by `ladder compare mlflow:ID`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests import cli_fork
from tests.ladder.test_tracking_server import Server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
OLMO_CONFIG = REPO / "tests" / "ladder" / "data" / "olmo_core_olmoe_config.json"
LADDER = [sys.executable, "-m", "ladder.cli"]
SPIKE_STEP, RISE_STEP, FIRST_END, LAST_STEP = 120, 300, 250, 400

# A training script's logging, as OLMo-core names its metrics, with MLflow and nothing else.
LOGGER = textwrap.dedent("""
    import math, random, sys, time
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    uri, first, last, run_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    c = MlflowClient(tracking_uri=uri)
    if run_id == "new":
        exp = c.get_experiment_by_name("olmoe-watch")
        exp_id = exp.experiment_id if exp else c.create_experiment("olmoe-watch")
        run_id = c.create_run(exp_id, run_name="olmoe-1b7b").info.run_id
    rng = random.Random(first)
    t0 = int(time.time() * 1000)
    points = []
    for step in range(first, last + 1):
        loss = 2.4 + 7.0 / math.sqrt(step) + rng.gauss(0, 0.01)
        if step == %(spike)d:
            loss += 0.5                                   # a loss spike
        gn = (0.4 if step < %(rise)d else 3.0) + rng.gauss(0, 0.02)   # grad norm rises past 2
        points += [Metric("train/CE loss", loss, t0 + step, step),
                   Metric("optim/total grad norm", gn, t0 + step, step),
                   Metric("throughput/device/TPS", 52000.0, t0 + step, step)]
    for i in range(0, len(points), 900):
        c.log_batch(run_id, metrics=points[i:i + 900])
    if last >= %(end)d:
        c.set_terminated(run_id, "FINISHED")
    print(run_id)
""") % {"spike": SPIKE_STEP, "rise": RISE_STEP, "end": LAST_STEP}


@pytest.fixture(scope="module")
def server(tmp_path_factory, mlflow_template):
    s = Server(tmp_path_factory.mktemp("mlflow-watch"), mlflow_template)
    s.start()
    yield s
    if s.proc and s.proc.poll() is None:
        s.kill()


def log_steps(tmp: Path, uri: str, first: int, last: int, run_id: str = "new") -> str:
    script = tmp / "olmo_logger.py"
    script.write_text(LOGGER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no project code on the path
    out = subprocess.run([sys.executable, str(script), uri, str(first), str(last), run_id], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def cli(*args, cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return cli_fork.ladder(*args, cwd=cwd, env=env, timeout=timeout)


def band_forecast(path: Path, steps: int) -> Path:
    s = np.arange(1, steps + 1, dtype=float)
    mid = 2.4 + 7.0 / np.sqrt(s)
    doc = {"trajectory": {"step": s.tolist(), "loss": mid.tolist(), "lo": (mid * 0.9).tolist(), "hi": (mid * 1.1).tolist()},
           "hero": {"final_loss": {"mean": float(mid[-1]), "lo": 0, "hi": 9, "level": 0.9}}}
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory) -> Path:
    """The run's spec, from OLMo-core's config.json: 1,000 steps of 1,024 x 4,096 tokens, 50 warmup."""
    tmp = tmp_path_factory.mktemp("olmoe-spec")
    path = tmp / "olmoe.yaml"
    made = cli("spec", "from-run", "--config", str(OLMO_CONFIG), "--name", "olmoe-1b7b", "--out", str(path),
               "--set", "data.total_tokens=4194304000", "--set", "schedule.warmup_steps=50", cwd=tmp)
    assert made.returncode == 0, made.stderr
    return path


def test_compare_flags_an_olmo_core_runs_planted_spike_and_grad_norm_rise_and_follow_reads_only_new_steps(
        server, spec_path, tmp_path):
    forecast = band_forecast(tmp_path / "forecast.json", 1000)
    run_id = log_steps(tmp_path, server.uri, 1, FIRST_END)

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [*LADDER, "compare", f"mlflow:{run_id}", "--tracking-uri", server.uri, "--metric-names", "olmo-core",
         "--forecast", str(forecast), "--spec", str(spec_path), "--follow", "--interval", "0.5", "--max-wait", "240",
         "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + 300  # a hang guard
    while not any(f"step {FIRST_END} (running)" in ln for ln in lines) and time.time() < deadline:
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.2)
    assert any(f"step {FIRST_END}" in ln for ln in lines), "".join(lines)
    seen_before = "".join(lines)
    log_steps(tmp_path, server.uri, FIRST_END + 1, LAST_STEP, run_id)
    stdout, _ = proc.communicate(timeout=900)
    reader.join(10)
    assert proc.returncode == 1, "".join(lines) + stdout  # exit by the worst severity: the planted warnings

    report = json.loads(stdout)
    flags = {f["kind"]: f for f in report["flags"]}
    assert flags["loss_spike"]["first_step"] == SPIKE_STEP
    assert RISE_STEP <= flags["grad_norm_high"]["first_step"] <= RISE_STEP + 2  # a median of 3 points
    assert "grad_norm_high" not in seen_before  # it came from the steps --follow read later
    assert "loss_above_band" not in flags and "loss_below_band" not in flags
    assert report["summary"]["step"] == LAST_STEP
    # tokens from the spec's 1,024 x 4,096 batch: the run logged steps only
    assert report["summary"]["tokens"] == LAST_STEP * 1024 * 4096
    # every point was fetched once: the follow-up reads asked only for what was new
    assert report["source"]["points_fetched"] == 2 * LAST_STEP
    assert report["source"]["kind"] == "mlflow" and report["source"]["metric_names"] == "olmo-core"


def test_replan_reads_an_mlflow_run_under_its_stacks_names_with_the_spec_from_its_config(server, spec_path, tmp_path):
    run_id = log_steps(tmp_path, server.uri, 1, 200)
    out = cli("replan", f"mlflow:{run_id}", "--tracking-uri", server.uri, "--metric-names", "olmo-core",
              "--spec", str(spec_path), "--days", "30", "--tokens-per-s", "4e6", "--json", "--out", str(tmp_path / "rp"),
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["run"]["step"] == 200 and plan["run"]["name"] == "olmoe-1b7b"
    assert any(f["kind"] == "loss_spike" and f["first_step"] == SPIKE_STEP for f in plan["flags"])
    assert plan["options"] and (tmp_path / "rp").is_dir()


def test_follow_outlives_a_tracking_server_restart_and_reads_every_point_once(server, tmp_path):
    run_id = log_steps(tmp_path, server.uri, 1, 100)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [*LADDER, "compare", f"mlflow:{run_id}", "--tracking-uri", server.uri, "--metric-names", "olmo-core",
         "--follow", "--interval", "0.5", "--max-wait", "240", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()

    def wait_for(text: str) -> None:
        deadline = time.time() + 300  # a hang guard
        while not any(text in ln for ln in lines) and time.time() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert any(text in ln for ln in lines), "".join(lines)

    wait_for("step 100 (running)")
    server.kill()
    wait_for("failed")  # the watcher says the read failed and goes on
    server.start()
    log_steps(tmp_path, server.uri, 101, LAST_STEP, run_id)
    stdout, _ = proc.communicate(timeout=900)
    assert proc.returncode == 1, "".join(lines) + stdout  # the planted spike and grad-norm rise: warnings
    report = json.loads(stdout)
    assert report["summary"]["step"] == LAST_STEP
    assert report["source"]["points_fetched"] == 2 * LAST_STEP
