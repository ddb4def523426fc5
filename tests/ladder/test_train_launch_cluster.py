"""A Ray cluster of two nodes on this machine (`ray start --head` and `ray start --address`, two
CPUs each) runs one spec as a 4-worker Ray Train job across both nodes, through the controller;
a worker SIGKILLed mid-run is restarted with its group from the newest sharded checkpoint, and
the run ends in the weights of an uninterrupted run of the same spec (4 ranks, no Ray)."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from core.spec import save_spec
from engines.base import read_metrics, read_status
from engines.torch.parallel.checkpoint import latest_sharded, read_full
from ladder import ledger
from ladder.controller import submit
from ladder.experiment import load_experiment
from ladder.localray import join, wait_reachable
from ladder.train_launch import train_on_workers
from tests.support import tiny_spec
from tests.engines.fork_ranks import drive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
STEPS = 12
CHANGES = {"model.ep_size": 2, "model.dispatch": "capacity", "model.n_waves": 2, "model.capacity_factor_send": 1.0,
           "model.capacity_factor_recv": 1.0, "model.init_std": 0.3, "hardware.workers": 4,
           "hardware.task_cpus": 1, "run.eval_every": 6}


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _worker_ports(n: int, taken: set[int]) -> int:
    """The first of `n` consecutive free ports below the kernel's ephemeral range (32768 up, where
    `_ports` draws every other port, so no component's port can fall inside a node's worker range)
    and above Ray's default worker range (10002-19999, other local Rays on this machine), none in
    `taken` (the other node's range)."""
    rng = random.Random()
    for _ in range(200):
        lo = rng.randrange(20000, 32768 - n)
        block = range(lo, lo + n)
        if taken.isdisjoint(block) and all(_free(p) for p in block):
            taken.update(block)
            return lo
    raise RuntimeError(f"no {n} consecutive free ports between 20000 and 32767")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _node_args(head: bool, gcs: int, ports: list[int], worker_ports_taken: set[int]) -> list[str]:
    """`ports`: seven distinct ports for the node's components, drawn with every other node's in one
    `_ports` call (drawn apart, a port the head has not bound yet could be drawn again)."""
    nm, om, rc, dg, dl, me, re_ = ports
    lo = _worker_ports(61, worker_ports_taken)
    args = [RAY, "start", "--block", "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
            "--node-manager-port", str(nm), "--object-manager-port", str(om), "--metrics-export-port", str(me),
            "--dashboard-agent-grpc-port", str(dg), "--dashboard-agent-listen-port", str(dl),
            "--runtime-env-agent-port", str(re_), "--min-worker-port", str(lo), "--max-worker-port", str(lo + 60),
            "--disable-usage-stats"]
    if head:
        return args + ["--head", "--port", str(gcs), "--include-dashboard", "false", "--ray-client-server-port", str(rc),
                       "--resources", json.dumps({"first_node": 1})]
    return args + ["--address", f"127.0.0.1:{gcs}", "--resources", json.dumps({"second_node": 1})]


@pytest.fixture(scope="module")
def two_nodes():
    """The address of a two-node cluster whose processes this fixture alone started and stops
    (token authentication off: loopback, and the test's own processes only)."""
    import ray

    auth_before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # Ray's socket paths must stay short
    gcs, *ports = _ports(15)
    taken: set[int] = set()  # the worker ports of the nodes started so far
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MOE_LADDER_OPTIONS="cpu_threads=1",
               RAY_TMPDIR=temp)
    log = open(Path(temp) / "nodes.log", "wb")
    head = subprocess.Popen(_node_args(True, gcs, ports[:7], taken) + ["--temp-dir", temp], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    procs = [head]
    try:
        wait_reachable(f"127.0.0.1:{gcs}", 300)  # a hang guard: a loaded machine starts a head slowly
        def second_node(component_ports):
            procs.append(subprocess.Popen(_node_args(False, gcs, component_ports, taken), env=env, stdout=log,
                                          stderr=log, start_new_session=True))

        second_node(ports[7:])
        join(f"127.0.0.1:{gcs}", 300, log_to_driver=False)  # asks again while the head's raylet registers
        deadline = time.time() + 300  # a hang guard: a loaded machine starts a raylet slowly
        restarts = 0
        while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
            if procs[-1].poll() is not None and restarts < 2:
                # its `ray start` gave up: Ray waits a fixed 30 s for a new raylet to register, which
                # a loaded machine can outlast; what it left is stopped, and it starts again on fresh
                # ports (the head's are all bound by now, so a new draw cannot take one of them)
                try:
                    os.killpg(procs[-1].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                restarts += 1
                second_node(_ports(7))
            time.sleep(0.5)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2, (Path(temp) / "nodes.log").read_text()[-3000:]
        yield f"127.0.0.1:{gcs}"
    finally:
        ray.shutdown()
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        if auth_before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _uninterrupted(spec, root: Path) -> Path:
    save_spec(spec, root / "spec.yaml")
    run = root / "plain4"
    jobs = [[4, [str(root / "spec.yaml"), "--run-dir", str(run), "--device", "cpu"]]]
    assert drive("engines.torch.parallel.train", jobs, join_s=240, timeout=600) == [[0, 0, 0, 0]]
    return run


def test_a_four_worker_job_across_two_nodes_survives_a_killed_worker_with_the_same_weights(
        two_nodes, write_experiment, seeded_root, tmp_path):
    path = write_experiment("mesh", [("m4", CHANGES)], steps=STEPS, checkpoint_every=4)
    spec = load_experiment(path).rungs[0]
    run_dir = ledger.run_dir_for(seeded_root, "mesh", spec)
    box: dict = {}

    def go() -> None:
        try:
            box["r"] = submit(path, root=seeded_root, address=two_nodes, console=Console(file=io.StringIO()))
        except BaseException as err:  # shown by the assertions below
            box["error"] = err

    th = threading.Thread(target=go)
    th.start()
    killed = None
    deadline = time.time() + 900
    while killed is None and time.time() < deadline and th.is_alive():
        recs = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if latest_sharded(run_dir) is not None and 5 <= len(recs) < STEPS - 2:
            victim = json.loads((run_dir / "workers" / "rank2.json").read_text())
            os.kill(victim["pid"], signal.SIGKILL)
            killed = victim
        time.sleep(0.05)
    th.join(1200)  # a hang guard
    assert killed is not None, f"no worker was killed mid-run: {box}"
    assert "r" in box, box.get("error")
    assert box["r"].ok, box["r"].outcomes
    assert read_status(run_dir)["state"] == "finished"
    ranks = [json.loads((run_dir / "workers" / f"rank{r}.json").read_text()) for r in range(4)]
    assert len({r["node"] for r in ranks}) == 2  # the job spans both nodes
    assert json.loads((run_dir / "workers" / "rank2.json").read_text())["pid"] != killed["pid"]  # restarted
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS))
    plain = _uninterrupted(spec, tmp_path)
    got, got_opt, state = read_full(latest_sharded(run_dir))
    ref, ref_opt, _ = read_full(latest_sharded(plain))
    assert state["step"] == STEPS
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k
    for k in ref_opt:
        assert np.array_equal(got_opt[k], ref_opt[k]), k


def test_closing_the_launch_ends_every_worker_after_one_step(two_nodes, tmp_path):
    spec = tiny_spec("s4", STEPS, 4, **CHANGES)
    run_dir = tmp_path / "run"
    steps = train_on_workers(spec, run_dir)
    got = [next(steps).step for _ in range(3)]
    workers = [json.loads((run_dir / "workers" / f"rank{r}.json").read_text())["pid"] for r in range(4)]
    steps.close()  # as a cancelled controller task does
    assert got == [0, 1, 2]
    deadline = time.time() + 300  # a hang guard
    while any(_alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)
    assert len(read_metrics(run_dir)) < STEPS and read_status(run_dir)["state"] != "finished"
