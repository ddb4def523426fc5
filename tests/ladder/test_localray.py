"""The controller's local Ray: loopback only, and nothing left behind by a driver killed with SIGKILL;
joining an address that does not answer fails within its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ladder.errors import LadderError
from ladder.localray import descendants, host_port, proc_start, wait_reachable

ROOT = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent("""
    import json, logging, os, subprocess, sys, time
    from ladder.localray import LocalRay, descendants
    LocalRay(1, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    procs = descendants(os.getpid())
    pids = {str(p) for p, _ in procs}
    listen = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
    mine = [ln.split()[3] for ln in listen if any(f"pid={p}," in ln for p in pids)]
    print(json.dumps({"procs": procs, "listen": mine}), flush=True)
    time.sleep(600)
    """)


@pytest.mark.slow
def test_a_sigkilled_driver_leaves_no_ray_process_and_its_ray_listened_on_loopback_only():
    p = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        info = json.loads(p.stdout.readline())
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    procs = [(int(pid), start) for pid, start in info["procs"]]
    assert len(procs) >= 4  # gcs, raylet, its agents, a worker
    assert info["listen"], "Ray's processes listened on nothing ss could see"
    assert all(addr.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for addr in info["listen"]), info["listen"]
    deadline = time.monotonic() + 300  # a hang guard
    while time.monotonic() < deadline and any(proc_start(pid) == start for pid, start in procs):
        time.sleep(0.5)
    alive = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]) for pid, start in procs if proc_start(pid) == start]
    assert not alive, alive


STALLED = textwrap.dedent("""
    import json, logging, os, signal, threading, time
    from pathlib import Path
    import ray
    from ladder.localray import LocalRay, descendants, proc_start

    stopped = []
    def stop_first_raylet():  # the first node's raylet hangs before it registers with the GCS
        while not stopped:
            for pid, start in descendants(os.getpid()):
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if comm == "raylet":
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append((pid, start))
                    return
            time.sleep(0.005)
    threading.Thread(target=stop_first_raylet, daemon=True).start()
    ray_ = LocalRay(1, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    answer = ray.get(ray.remote(lambda: 42).remote())
    print(json.dumps({"answer": answer, "stopped": stopped,
                      "stopped_alive": [proc_start(p) == s for p, s in stopped]}), flush=True)
    ray_.shutdown()
    """)


@pytest.mark.slow
def test_a_node_that_never_registers_is_killed_and_ray_started_again():
    """Ray waits a fixed 30 s for its node; a raylet stopped before it registers (a machine too busy
    to schedule it) is killed with the rest of that start, and the second start serves tasks."""
    done = subprocess.run([sys.executable, "-c", STALLED], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["answer"] == 42
    assert len(info["stopped"]) == 1 and info["stopped_alive"] == [False]
    assert "did not register in time (start 1 of 3); starting it again" in done.stderr

def test_an_address_that_does_not_answer_fails_within_its_timeout():
    t0 = time.monotonic()
    with pytest.raises(LadderError, match=r"cannot reach Ray at 127.0.0.1:1 within 1.5 s"):
        wait_reachable("127.0.0.1:1", 1.5)
    assert time.monotonic() - t0 < 120  # a hang, not a speed: the wait itself is 1.5 s


def test_ray_addresses_are_host_and_port_or_left_to_ray():
    assert host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert host_port("ray://head:10001") == ("head", 10001)
    assert host_port("auto") is None
    with pytest.raises(LadderError, match="not host:port"):
        host_port("head:port")


def test_descendants_lists_children_with_their_start_times():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = dict(descendants(os.getpid()))
        assert found.get(child.pid) == proc_start(child.pid) is not None
    finally:
        child.kill()
        child.wait()


def test_joining_a_port_that_answers_but_is_not_ray_fails_in_one_line_within_its_timeout(tmp_path):
    exp = tmp_path / "exp.py"
    exp.write_text("from ladder.experiment import Experiment\nfrom ladder.presets import micro_spec\n"
                   "EXPERIMENT = Experiment(name='web', rungs=(micro_spec('a'),))\n")
    web = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(web.stdout.readline().split(" port ")[1].split()[0])
        proc = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(exp), "--address", f"127.0.0.1:{port}",
                               "--ray-timeout", "3", "--no-tracking", "--root", str(tmp_path / "root")],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=600)  # only to catch the hang
    finally:
        web.kill()
        web.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port} accepts connections but does not answer as Ray within" in lines[0], \
        proc.stderr[-3000:]
