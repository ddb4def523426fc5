"""The controller on a real local Ray (2 CPUs) with the torch engine and a real MLflow store."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from engines.base import read_metrics
from ladder import ledger, tracking
from ladder.controller import submit
from ladder.errors import LadderError
from ladder.experiment import load_experiment
from tests import cli_fork
from tests.support import tiny_changes

pytestmark = pytest.mark.slow

STEPS = 60
RUNGS = [("a", {}), ("b", {"model.d_model": 64, "model.head_dim": 16}), ("c", {"seed": 1})]


def quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


def attempts(run_dir: Path) -> list[dict]:
    p = run_dir / "attempts.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def assert_each_step_once(uri: str, experiment: str, spec, run_dir: Path) -> None:
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(spec.total_steps)), "metrics.jsonl must hold every step exactly once"
    runs = [r for r in tracking.child_runs(uri, experiment) if r.data.tags["spec_id"] == spec.id]
    assert len(runs) == 1, f"{spec.name}: {len(runs)} MLflow runs"
    assert runs[0].info.status == "FINISHED"
    logged = tracking.iter_metric_points(uri, runs[0].info.run_id, ["loss", "grad_norm"])
    for key, got in logged.items():
        assert sorted(got) == list(range(spec.total_steps)), f"{spec.name}: MLflow {key} steps lost or duplicated"


@pytest.fixture(scope="module")
def sweep(local_ray, tmp_path_factory):
    """A finished sweep of three tiny specs: (experiment file, root, SubmitResult)."""
    tmp = tmp_path_factory.mktemp("sweep")
    path = tmp / "sweep.py"
    path.write_text(
        "from ladder.experiment import Experiment\nfrom ladder.presets import micro_spec\n"
        f"BASE = {tiny_changes(STEPS, 10)!r}\n"
        f"EXPERIMENT = Experiment(name='sweep', rungs=tuple(micro_spec(n, **{{**BASE, **c}}) for n, c in {RUNGS!r}))\n"
    )
    root = tmp / ".ladder"
    result = submit(path, root=root, console=quiet())
    return path, root, result


def test_a_sweep_runs_every_spec_to_completion(sweep):
    path, root, result = sweep
    exp = load_experiment(path)
    assert result.ok and sorted(o["outcome"] for o in result.outcomes.values()) == ["finished"] * 3
    frame = ledger.runs_frame(root, path)
    assert list(frame["state"]) == ["finished"] * 3
    assert list(frame["step"]) == [STEPS - 1] * 3
    uri = tracking.default_tracking_uri(root)
    for spec in exp.rungs:
        d = ledger.run_dir_for(root, "sweep", spec)
        assert len(attempts(d)) == 1
        assert_each_step_once(uri, "sweep", spec, d)
    parent = tracking.client(uri).get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["ladder.kind"] == "submission"
    children = tracking.child_runs(uri, "sweep")
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {result.parent_run_id}
    assert set(frame["mlflow_run_id"]) == {r.info.run_id for r in children}


def test_resubmitting_a_finished_sweep_trains_nothing(sweep):
    path, root, _ = sweep
    exp = load_experiment(path)
    before = {s.name: attempts(ledger.run_dir_for(root, "sweep", s)) for s in exp.rungs}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(root)],
        capture_output=True, text=True, timeout=600,
    )
    elapsed = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    assert "nothing to train" in out.stderr
    assert {s.name: attempts(ledger.run_dir_for(root, "sweep", s)) for s in exp.rungs} == before
    print(f"resubmitting a finished 3-spec sweep took {elapsed:.1f}s (a CLI process, no Ray started)")


def test_a_worker_killed_mid_run_is_retried_and_resumes_to_the_same_loss(sweep, tmp_path, seeded_root):
    """SIGKILL the worker process training a spec; Ray retries the task, the engine resumes from
    its checkpoint, and the curve equals the uninterrupted run of the same spec in the sweep."""
    path, sweep_root, _ = sweep
    ref_spec = load_experiment(path).rungs[0]
    exp_file = tmp_path / "again.py"
    exp_file.write_text(path.read_text().replace("name='sweep'", "name='again'"))
    root = seeded_root
    run_dir = ledger.run_dir_for(root, "again", ref_spec)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("r", submit(exp_file, only="^a$", root=root, console=quiet())))
    th.start()
    killed = None
    deadline = time.time() + 900  # a hang guard
    while killed is None and time.time() < deadline and th.is_alive():
        recs = read_metrics(run_dir) if run_dir.exists() else []
        if recs and recs[-1]["step"] >= 12:
            pid = attempts(run_dir)[-1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed = (pid, recs[-1]["step"])
        time.sleep(0.02)
    th.join(1200)  # a hang guard: a whole submission on a loaded machine
    assert killed is not None, "the run ended before it could be killed"
    assert killed[1] < STEPS - 1
    result = box["r"]
    assert result.ok, result.outcomes
    tries = attempts(run_dir)
    assert len(tries) == 2 and tries[0]["pid"] == killed[0] and tries[1]["pid"] != killed[0]
    resumed = read_metrics(run_dir)
    reference = read_metrics(ledger.run_dir_for(sweep_root, "sweep", ref_spec))
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]  # bit-exact on the CPU
    assert_each_step_once(tracking.default_tracking_uri(root), "again", ref_spec, run_dir)


def test_a_gpu_request_on_a_gpu_less_cluster_is_refused_at_once(local_ray, write_experiment, tmp_path):
    path = write_experiment("gpu", [("g", {"hardware.task_gpus": 1}), ("ok", {})])
    root = tmp_path / ".ladder"
    with pytest.raises(LadderError) as err:
        submit(path, root=root, console=quiet())
    msg = str(err.value)
    assert "spec g" in msg and "1 GPU" in msg and "no GPU" in msg and "spec ok" not in msg
    assert not (root / "runs").exists() and not (root / "mlflow.db").exists()  # nothing submitted


def test_a_cpu_request_larger_than_any_node_is_refused_naming_the_cpus(local_ray, write_experiment, tmp_path):
    path = write_experiment("cpu", [("big", {"hardware.task_cpus": 64})])
    with pytest.raises(LadderError, match=r"spec big .* 64 CPU.*largest: 2"):
        submit(path, root=tmp_path / ".ladder", console=quiet())


def test_dry_run_shows_the_plan_and_writes_nothing(write_experiment, tmp_path):
    path = write_experiment("dry", [("a", {}), ("b", {"seed": 3})], hero=("h", {"seed": 9}))
    con = quiet()
    result = submit(path, root=tmp_path / ".ladder", dry_run=True, include_hero=True, engine="jax", console=con)
    text = con.file.getvalue()
    assert [p.spec.name for p in result.planned] == ["a", "b", "h"]
    assert all(p.spec.engine == "jax" for p in result.planned) and "jax" in text and "h" in text
    assert not (tmp_path / ".ladder").exists()


def test_an_only_pattern_that_matches_nothing_names_the_specs(write_experiment, tmp_path):
    path = write_experiment("sel", [("a", {}), ("b", {"seed": 3})])
    with pytest.raises(LadderError, match=r"matches no spec .*a, b"):
        submit(path, only="^zzz$", root=tmp_path / ".ladder", console=quiet())


def test_two_concurrent_submissions_train_each_spec_once(local_ray, write_experiment, seeded_root):
    path = write_experiment("twice", [("a", {"seed": 5}), ("b", {"seed": 6}), ("c", {"seed": 7})], steps=30)
    root = seeded_root
    results: list = []

    def one() -> None:
        results.append(submit(path, root=root, console=quiet()))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(1200)  # a hang guard: a whole submission on a loaded machine
    assert len(results) == 2 and all(r.ok for r in results), [r.outcomes for r in results]
    exp = load_experiment(path)
    uri = tracking.default_tracking_uri(root)
    contested = 0
    for spec in exp.rungs:
        d = ledger.run_dir_for(root, "twice", spec)
        assert len(attempts(d)) == 1, f"{spec.name} was trained {len(attempts(d))} times"
        outcomes = sorted(r.outcomes[spec.id]["outcome"] for r in results if spec.id in r.outcomes)
        assert outcomes in (["finished", "skipped"], ["finished"]), outcomes
        contested += outcomes == ["finished", "skipped"]
        assert_each_step_once(uri, "twice", spec, d)
    assert contested, "the two submissions never competed for a spec"


def test_status_and_runs_json_show_the_ledger(sweep):
    path, root, result = sweep
    runs = cli_fork.ladder("runs", "--json", "--root", root, timeout=600)
    assert runs.returncode == 0, runs.stderr
    rows = json.loads(runs.stdout)
    assert sorted(r["name"] for r in rows) == ["a", "b", "c"]
    assert {r["state"] for r in rows} == {"finished"} and all(r["mlflow_run_id"] for r in rows)
    status = cli_fork.ladder("status", path, "--root", root, env={**os.environ, "COLUMNS": "160"}, timeout=600)
    assert status.returncode == 0, status.stderr
    for spec in load_experiment(path).rungs:
        assert spec.id[:8] in status.stdout  # the table's short id
    assert status.stdout.count("finished") == 3 and f"{STEPS}/{STEPS}" in status.stdout


def test_the_cli_refuses_a_gpu_request_before_starting_a_local_ray(write_experiment, tmp_path):
    import subprocess
    import sys
    import time

    path = write_experiment("gpu_cli", [("g", {"hardware.task_gpus": 1})])
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(tmp_path / ".ladder")],
                         capture_output=True, text=True, env={**__import__("os").environ, "RAY_ADDRESS": ""})
    assert out.returncode == 2 and "spec g" in out.stderr and "no GPU" in out.stderr
    assert "Ray" not in out.stdout  # no local Ray came up to say anything
    assert not (tmp_path / ".ladder" / "runs").exists()
    print(f"refused in {time.perf_counter() - t0:.1f} s")


def test_catching_up_with_nothing_to_train_closes_a_dead_submissions_parent_run(sweep, tmp_path):
    import shutil
    import socket

    path, root, _ = sweep
    copy = tmp_path / ".ladder"
    shutil.copytree(root, copy)  # another store: every finished run is a backlog to catch up
    uri = tracking.default_tracking_uri(copy)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    c = tracking.client(uri)
    dead = c.create_run(tracking.experiment_id(uri, "sweep"), tags={
        "ladder.kind": "submission", "host": socket.gethostname(), "pid": gone.stdout.strip()})
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(copy)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "nothing to train" in out.stderr, out.stderr
    assert "uploaded" in out.stderr  # the catch-up ran
    assert c.get_run(dead.info.run_id).info.status == "KILLED"
