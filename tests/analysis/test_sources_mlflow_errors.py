"""`ladder compare mlflow:ID` says what went wrong: a tracking server that does not answer is
"cannot reach", a run the server does not hold is "no such run"; a loss logged as infinite (which
MLflow's SQL store keeps as the largest finite double) is a non-finite point, flagged `non_finite`;
numpy's floating-point warnings stay off stderr."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cli_fork
from tests.ladder.test_tracking_server import Server

REPO = Path(__file__).resolve().parents[2]
INF_STEP = 40


def compare(*args, cwd: Path) -> subprocess.CompletedProcess:
    return cli_fork.ladder("compare", *args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def test_a_tracking_server_that_does_not_answer_is_called_unreachable_not_a_missing_run(tmp_path):
    with socket.socket() as s:  # a port on 127.0.0.1 where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = compare("mlflow:0123456789abcdef0123456789abcdef", "--tracking-uri", f"http://127.0.0.1:{port}", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"cannot reach the tracking server http://127.0.0.1:{port}" in lines[0] and "no such run" not in lines[0]



def test_a_sqlite_store_that_does_not_exist_is_named_and_not_created(tmp_path):
    r = compare("mlflow:0123456789abcdef0123456789abcdef", "--tracking-uri", "sqlite:///missing.db", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "no MLflow store at sqlite:///missing.db" in lines[0]
    assert not (tmp_path / "missing.db").exists()

@pytest.fixture(scope="module")
def server(tmp_path_factory, mlflow_template):
    s = Server(tmp_path_factory.mktemp("mlflow-errors"), mlflow_template)
    s.start()
    yield s
    if s.proc and s.proc.poll() is None:
        s.kill()


@pytest.mark.slow
def test_a_run_the_server_does_not_hold_is_no_such_run(server, tmp_path):
    r = compare("mlflow:0123456789abcdef0123456789abcdef", "--tracking-uri", server.uri, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"no such run at {server.uri}" in lines[0]


@pytest.mark.slow
def test_an_infinite_loss_logged_to_mlflow_is_flagged_non_finite_with_nothing_on_stderr(server, tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    c = MlflowClient(tracking_uri=server.uri)
    run_id = c.create_run(c.create_experiment("inf-loss")).info.run_id
    t0 = int(time.time() * 1000)
    points = []
    for step in range(80):
        loss = math.inf if step == INF_STEP else 2.4 + 7.0 / math.sqrt(step + 1)
        points += [Metric("loss", loss, t0 + step, step), Metric("grad_norm", 0.4, t0 + step, step)]
    c.log_batch(run_id, metrics=points)
    assert c.get_metric_history(run_id, "loss")[INF_STEP].value == sys.float_info.max  # how the store keeps it

    r = compare(f"mlflow:{run_id}", "--tracking-uri", server.uri, "--json", cwd=tmp_path)
    assert r.returncode == 3, r.stderr  # critical
    assert r.stderr == ""  # no numpy warnings about the point
    flags = {f["kind"]: f for f in json.loads(r.stdout)["flags"]}
    assert flags["non_finite"]["first_step"] == INF_STEP and flags["non_finite"]["severity"] == "critical"
    assert "loss_jump" not in flags
