"""A mesh run on one host listens on 127.0.0.1 only: `ladder train` of an ep_size 2 spec in two
processes (torchrun, gloo), with MASTER_ADDR=127.0.0.1, has no TCP listener on any other address
while it trains (torch's TCPStore server listens on [::] unless handed a bound socket)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.rundir import RunDir
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SPEC = micro_spec("ep2-loopback", **{"model.ep_size": 2, "data.seq_len": 32, "data.batch_size": 4,
                                      "data.total_tokens": 32 * 4 * 5000, "run.eval_every": 10**6,
                                      "run.eval_batches": 1, "run.checkpoint_every": 10**6})


def _tree(pid: int) -> set[int]:
    """pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, []))
    return out


def _address(hex_addr: str) -> str:
    ip, port = hex_addr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return f"{ipaddress.IPv4Address(raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc's IPv6: four host-order words
    return f"[{ipaddress.IPv6Address(words)}]:{int(port, 16)}"


def listeners(pids: set[int]) -> dict[str, int]:
    """address:port -> pid of every listening TCP socket the processes `pids` hold."""
    inode_pid = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inode_pid[link[8:-1]] = pid
        except OSError:  # gone meanwhile
            continue
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inode_pid:  # LISTEN
                out[_address(f[1])] = inode_pid[f[9]]
    return out


def test_a_two_process_mesh_run_listens_on_127_0_0_1_only(tmp_path):
    spec_path, run_dir = tmp_path / "spec.yaml", tmp_path / "run"
    spec_path.write_text(SPEC.to_yaml())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MOE_LADDER_OPTIONS": "torch_ep=processes,cpu_threads=1"}
    proc = subprocess.Popen([sys.executable, "-m", "ladder.cli", "train", str(spec_path), "--run-dir", str(run_dir),
                             "--quiet"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 300  # only to catch a hang
        while time.time() < deadline and RunDir(run_dir).metrics_rows() < 3:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        assert RunDir(run_dir).metrics_rows() >= 3, "the ranks never trained"
        pids = _tree(proc.pid)
        assert len(pids) >= 4  # the command, torchrun and its two ranks
        found = listeners(pids)
        assert found, "a mesh run holds its store's listening socket"
        wide = {a: pid for a, pid in found.items() if not ipaddress.ip_address(a.rsplit(":", 1)[0].strip("[]")).is_loopback}
        assert not wide, f"listening beyond loopback: {wide} of {found}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
