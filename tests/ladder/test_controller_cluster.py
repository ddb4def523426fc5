"""A two-node Ray cluster (ray.cluster_utils.Cluster, one CPU a node, on loopback): the sweep
spreads over both nodes, and removing one mid-run loses no run."""

from __future__ import annotations

import io
import json
import logging
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

pytestmark = pytest.mark.slow

STEPS = 60


def attempts(run_dir: Path) -> list[dict]:
    p = run_dir / "attempts.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # quick failure detection, so a removed node is declared dead in about a second
    system = {"health_check_period_ms": 300, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": system})
    worker = c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level=logging.ERROR, log_to_driver=False)
    c.wait_for_nodes()
    yield c, worker
    ray.shutdown()
    c.shutdown()


def test_a_sweep_spreads_over_both_nodes_and_survives_losing_one(cluster, write_experiment, seeded_root):
    c, worker = cluster
    path = write_experiment("multi", [("a", {}), ("b", {"seed": 1}), ("c", {"seed": 2}), ("d", {"seed": 3})], steps=STEPS)
    exp = load_experiment(path)
    root = seeded_root
    dirs = {s.name: ledger.run_dir_for(root, "multi", s) for s in exp.rungs}
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = submit(path, root=root, console=Console(file=io.StringIO()))
        except BaseException as err:  # shown by the assertion below
            box["error"] = err

    th = threading.Thread(target=run)
    th.start()

    victim = None
    deadline = time.time() + 900  # a hang guard
    while victim is None and time.time() < deadline and th.is_alive():
        for name, d in dirs.items():
            tries = attempts(d)
            last = ledger.last_metrics(d)
            if tries and tries[-1]["node"] == worker.node_id and last and 12 <= last["step"] < STEPS - 10:
                victim = name
                break
        time.sleep(0.02)
    assert victim is not None, f"no run reached mid-way on the worker node: {box}"
    c.remove_node(worker)
    th.join(1200)  # a hang guard: a whole sweep on a loaded machine
    assert "r" in box, box.get("error")
    result = box["r"]
    assert result.ok, result.outcomes

    nodes_used = {t["node"] for d in dirs.values() for t in attempts(d)}
    assert worker.node_id in nodes_used and c.head_node.node_id in nodes_used  # both nodes trained
    tries = attempts(dirs[victim])
    assert [t["node"] for t in tries] == [worker.node_id, c.head_node.node_id]  # retried on the survivor
    uri = tracking.default_tracking_uri(root)
    children = {r.data.tags["spec_id"]: r for r in tracking.child_runs(uri, "multi")}
    for spec in exp.rungs:
        assert [m["step"] for m in read_metrics(dirs[spec.name])] == list(range(STEPS)), spec.name
        run = children[spec.id]
        assert run.info.status == "FINISHED"
        assert sorted(tracking.iter_metric_points(uri, run.info.run_id, ["loss"])["loss"]) == list(range(STEPS))
    assert len(children) == len(exp.rungs)


def test_a_gpu_request_is_refused_on_a_gpu_less_cluster(cluster, write_experiment, tmp_path):
    path = write_experiment("gpu", [("g", {"hardware.task_gpus": 2})])
    t0 = time.perf_counter()
    with pytest.raises(LadderError, match=r"spec g .*2 GPU.*the cluster has no GPU"):
        submit(path, root=tmp_path / ".ladder", console=Console(file=io.StringIO()))
    assert not (tmp_path / ".ladder" / "runs").exists()
    print(f"refused in {time.perf_counter() - t0:.2f}s")
