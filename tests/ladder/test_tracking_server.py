"""Tracking through a real `mlflow server` on 127.0.0.1, killed and restarted mid-run: no metric
point is lost or logged twice."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from engines.base import read_metrics
from ladder import ledger, tracking
from ladder.controller import submit
from ladder.experiment import load_experiment
from tests.support import tiny_spec

pytestmark = pytest.mark.slow


class Server:
    """`mlflow server` with a SQLite backend in its own process group (so it can be killed whole)."""

    def __init__(self, tmp: Path, template: Path):
        self.tmp = tmp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        shutil.copy(template, tmp / "server.db")  # an existing schema: starts are quicker
        self.db = f"sqlite:///{tmp / 'server.db'}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", self.db, "--artifacts-destination", str(self.tmp / "artifacts"), "--workers", "1"],
            stdout=open(self.tmp / "server.log", "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        deadline = time.time() + 300  # a hang guard
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"mlflow server did not come up: {(self.tmp / 'server.log').read_text()[-2000:]}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, mlflow_template):
    s = Server(tmp_path_factory.mktemp("mlflow-server"), mlflow_template)
    s.start()
    yield s
    if s.proc and s.proc.poll() is None:
        s.kill()


def assert_complete_and_unique(uri: str, run_id: str, run_dir: Path) -> None:
    recs = read_metrics(run_dir)
    keys = {k for r in recs for k, _ in tracking.record_metrics(r)}
    got = tracking.iter_metric_points(uri, run_id, keys)
    for k in keys:
        want = [r["step"] for r in recs if any(kk == k for kk, _ in tracking.record_metrics(r))]
        assert sorted(got[k]) == want, f"{k}: {len(got[k])} points in MLflow, {len(want)} in metrics.jsonl"


def test_an_outage_mid_run_is_caught_up_by_the_uploader_with_nothing_lost_or_doubled(server, tmp_path, monkeypatch):
    from engines.registry import get_engine

    for var, value in (("MAX_RETRIES", "1"), ("BACKOFF_FACTOR", "1"), ("TIMEOUT", "10")):
        monkeypatch.setenv(f"MLFLOW_HTTP_REQUEST_{var}", value)  # what the controller sets
    spec = tiny_spec("outage", steps=40)
    run_dir = tmp_path / "run"
    ledger.write_spec_file(run_dir, spec)
    tracker = tracking.RunTracker(server.uri, "server-outage", spec, run_dir).start(every_s=0.2)
    saw_error = False
    for m in get_engine("torch").train(spec, run_dir):
        if m.step == 10:
            time.sleep(0.5)  # let the first steps reach the server
            server.kill()
        if m.step == 25:
            deadline = time.time() + 300  # a hang guard
            while tracker.error is None and time.time() < deadline:
                time.sleep(0.1)
            saw_error = tracker.error is not None
            server.start()
    assert saw_error, "the tracker never noticed the outage"
    assert tracker.stop("finished") is True, tracker.error
    assert_complete_and_unique(server.uri, tracker.run_id, run_dir)
    assert tracking.client(server.uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_sweep_through_an_outage_then_ladder_sync_loses_and_doubles_nothing(server, local_ray, write_experiment, tmp_path):
    path = write_experiment("served", [("s", {})], steps=60)
    root = tmp_path / ".ladder"
    spec = load_experiment(path).rungs[0]
    run_dir = ledger.run_dir_for(root, "served", spec)
    box: dict = {}
    th = threading.Thread(
        target=lambda: box.setdefault("r", submit(path, root=root, tracking_uri=server.uri, console=Console(file=io.StringIO())))
    )
    th.start()
    killed_at = None
    deadline = time.time() + 900  # a hang guard
    while killed_at is None and th.is_alive() and time.time() < deadline:
        last = ledger.last_metrics(run_dir)
        opened = server.uri in ledger.read_tracking(run_dir) if run_dir.exists() else False
        if last is not None and last["step"] >= 10 and opened:
            server.kill()
            killed_at = last["step"]
        time.sleep(0.02)
    th.join(1200)  # a hang guard: a whole submission on a loaded machine
    assert killed_at is not None and killed_at < 59, "the run was over before the outage"
    result = box["r"]
    assert result.ok, result.outcomes  # training went on without the server
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(60))
    assert next(iter(result.outcomes.values()))["tracking_synced"] is False

    server.start()
    run_id = ledger.read_tracking(run_dir)[server.uri]["run_id"]
    before = tracking.iter_metric_points(server.uri, run_id, ["loss"])["loss"]
    assert len(before) < 60  # the outage really left a gap
    out = subprocess.run(
        [sys.executable, "-m", "ladder.cli", "sync", "served", "--root", str(root), "--tracking-uri", server.uri],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert_complete_and_unique(server.uri, run_id, run_dir)
    runs = tracking.child_runs(server.uri, "served")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
