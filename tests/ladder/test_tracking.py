"""MLflow tracking against a real SQLite store, fed by a run dir the torch engine really trained."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from engines.base import read_metrics
from ladder import ledger, tracking
from ladder.experiment import Experiment
from tests import cli_fork
from tests.support import tiny_spec

pytestmark = pytest.mark.slow

STEPS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(spec, run dir) of a tiny spec trained to the end by the torch engine."""
    from engines.registry import get_engine

    spec = tiny_spec("t", steps=STEPS, checkpoint_every=12)
    d = tmp_path_factory.mktemp("trained") / "run"
    for _ in get_engine("torch").train(spec, d):
        pass
    ledger.write_spec_file(d, spec)
    return spec, d


def _copy(src: Path, dst: Path, keep_steps: int | None = None) -> Path:
    shutil.copytree(src, dst)
    if keep_steps is not None:
        lines = (src / "metrics.jsonl").read_text().splitlines()[:keep_steps]
        (dst / "metrics.jsonl").write_text("".join(l + "\n" for l in lines))
    return dst


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template):
    """(root, uri): one SQLite store for the module; each test logs to an experiment of its own."""
    root = tmp_path_factory.mktemp("root")
    shutil.copy(mlflow_template, root / "mlflow.db")
    uri = tracking.default_tracking_uri(root)
    tracking.prepare_store(uri)
    return root, uri


@pytest.fixture
def exp_name(request):
    return request.node.name


def _assert_history_matches(uri: str, run_id: str, run_dir: Path) -> None:
    recs = read_metrics(run_dir)
    keys = {k for r in recs for k, _ in tracking.record_metrics(r)}
    got = tracking.iter_metric_points(uri, run_id, keys)
    for k in keys:
        want = sorted(r["step"] for r in recs if any(kk == k for kk, _ in tracking.record_metrics(r)))
        assert sorted(got[k]) == want, f"metric {k}: MLflow has steps {sorted(got[k])}, metrics.jsonl {want}"


def test_upload_sends_every_point_once_in_batches(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    d = _copy(src, tmp_path / "run")
    c = tracking.client(uri)
    calls = []
    real = c.log_batch

    def counting_log_batch(run_id, metrics=(), params=(), tags=()):
        if metrics:
            calls.append(len(metrics))
        return real(run_id, metrics=metrics, params=params, tags=tags)

    c.log_batch = counting_log_batch
    try:
        t = tracking.RunTracker(uri, exp_name, spec, d)
        sent = t.upload()
    finally:
        del c.log_batch
    n_values = sum(len(tracking.record_metrics(r)) for r in read_metrics(d))
    assert sent == n_values
    assert len(calls) == -(-n_values // tracking.MAX_METRICS_PER_BATCH)  # ceil: full batches, not a call per value
    _assert_history_matches(uri, t.run_id, d)


def test_an_interrupted_upload_continues_where_mlflow_stopped(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    d = _copy(src, tmp_path / "run", keep_steps=10)
    first = tracking.RunTracker(uri, exp_name, spec, d)
    first.upload()
    shutil.copy(src / "metrics.jsonl", d / "metrics.jsonl")  # the run went on
    second = tracking.RunTracker(uri, exp_name, spec, d)  # a new process: it asks MLflow
    second.upload()
    assert second.run_id == first.run_id
    _assert_history_matches(uri, first.run_id, d)


def test_a_lost_tracking_file_finds_the_run_by_its_spec_id(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    d = _copy(src, tmp_path / "run")
    first = tracking.RunTracker(uri, exp_name, spec, d)
    first.upload()
    (d / ledger.TRACKING_FILE).unlink()
    again = tracking.RunTracker(uri, exp_name, spec, d)
    assert again.upload() == 0
    assert again.run_id == first.run_id
    assert len(tracking.child_runs(uri, exp_name)) == 1


def test_the_child_run_carries_tags_params_and_the_spec_yaml(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    d = _copy(src, tmp_path / "run")
    t = tracking.RunTracker(uri, exp_name, spec, d, experiment_file="/x/exp.py")
    t.upload()
    t.set_final("finished")
    run = tracking.client(uri).get_run(t.run_id)
    tags, params = run.data.tags, run.data.params
    assert (tags["spec_id"], tags["rung"], tags["role"], tags["engine"], tags["experiment_file"]) == (
        spec.id, "t", "rung", "torch", "/x/exp.py")
    assert params["model.d_model"] == "32" and params["optim.peak_lr"] == str(spec.optim.peak_lr)
    assert json.loads(params["data.sources"])[0]["name"] == "code"
    assert run.info.status == "FINISHED"
    arts = [a.path for a in tracking.client(uri).list_artifacts(t.run_id)]
    assert "spec.yaml" in arts


def test_a_resumed_run_keeps_its_child_run_under_the_new_submission(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    d = _copy(src, tmp_path / "run", keep_steps=8)
    exp = Experiment(name=exp_name, rungs=(spec,), path="/x/exp.py")
    sub1 = tracking.start_submission(uri, exp, [spec], {})
    t1 = tracking.RunTracker(uri, exp_name, spec, d, parent_run_id=sub1.run_id)
    t1.upload()
    t1.set_final("interrupted")
    sub2 = tracking.start_submission(uri, exp, [spec], {})
    shutil.copy(src / "metrics.jsonl", d / "metrics.jsonl")
    t2 = tracking.RunTracker(uri, exp_name, spec, d, parent_run_id=sub2.run_id, reopen=True)
    t2.upload()
    run = tracking.client(uri).get_run(t2.run_id)
    assert t2.run_id == t1.run_id
    assert run.data.tags["mlflow.parentRunId"] == sub2.run_id
    assert run.info.status == "RUNNING"
    _assert_history_matches(uri, t2.run_id, d)


def test_files_attach_to_the_ladders_latest_submission(tmp_path, store, exp_name):
    root, uri = store
    spec = tiny_spec("t")
    exp = Experiment(name=exp_name, rungs=(spec,))
    tracking.start_submission(uri, exp, [spec], {})
    latest = tracking.start_submission(uri, exp, [spec], {})
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    assert tracking.log_artifact_to_parent(exp_name, report, root=root) == latest.run_id
    forecast = {"hero": {"final_loss": {"mean": 1.9, "lo": 1.8, "hi": 2.0}}}
    assert tracking.log_forecast(exp, forecast, root=root) == latest.run_id
    c = tracking.client(uri)
    assert {a.path for a in c.list_artifacts(latest.run_id)} == {"report.html", "forecast.json"}
    assert c.get_run(latest.run_id).data.metrics["forecast.hero_final_loss.lo"] == pytest.approx(1.8)


def test_an_unreachable_server_is_reported_not_raised(tmp_path, trained, exp_name):
    spec, src = trained
    d = _copy(src, tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    tracking.bounded_http_retries()
    t = tracking.RunTracker(f"http://127.0.0.1:{port}", exp_name, spec, d).start(every_s=0.1)
    assert t.stop("finished", timeout_s=60) is False
    assert "connect" in (t.error or "").lower()


def test_ladder_sync_uploads_runs_mlflow_never_saw_and_then_nothing(tmp_path, trained, store, exp_name):
    root, uri = store
    spec, src = trained
    root = tmp_path / "root"  # run dirs of this test only, logged to the module's store
    d = _copy(src, ledger.run_dir_for(root, exp_name, spec))
    first = cli_fork.ladder("sync", "--root", root, "--tracking-uri", uri, timeout=600)
    assert first.returncode == 0, first.stderr
    runs = tracking.child_runs(uri, exp_name)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    _assert_history_matches(uri, runs[0].info.run_id, d)
    n_values = sum(len(tracking.record_metrics(r)) for r in read_metrics(d))
    assert f" {n_values} " in first.stdout.replace("│", " ")
    again = tracking.sync_runs(root, exp_name, uri)
    assert [r.uploaded for r in again] == [0]
    _assert_history_matches(uri, runs[0].info.run_id, d)
    assert len(tracking.child_runs(uri, exp_name)) == 1
