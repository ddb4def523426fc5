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
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(proc_start(pid) == start for pid, start in procs):
        time.sleep(0.5)
    alive = [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:80]) for pid, start in procs if proc_start(pid) == start]
    assert not alive, alive


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
