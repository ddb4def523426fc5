"""Ray for the controller: a local instance bound to 127.0.0.1 that leaves nothing behind, or a
cluster joined within a bounded time.

Local: Ray turns 127.0.0.1 into the machine's outward address unless it is told it runs no
cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read by the driver and every process it starts), so
the GCS, raylet, agents and workers listen on loopback only. Ray's own processes share the
driver's fate, but the raylet's dashboard and runtime-env agents outlive a driver killed with
SIGKILL (adopted by init, ~210 MB). A reaper process, started in its own session, holds a pipe
from the driver: when the pipe closes (the driver exited, however it died) it waits a grace period
for Ray's own shutdown and kills whichever of the recorded processes are still there (checked by
their kernel start time, so a reused pid is never hit). Ray waits a fixed 30 s for the new node to
register with its GCS; on a machine too busy for that the start's processes are killed and Ray is
started again, up to STARTS times.

Joining: `address` (or RAY_ADDRESS) host:port must accept a TCP connection and answer as a Ray
cluster's GCS (its GetClusterId call, over gRPC) within $MOE_LADDER_LIMITS ray_timeout_s seconds (default 30)
in all, or the submission stops with one line; Ray itself would retry for minutes, and a port that
answers but is not Ray's (a web server, another service) would hold ray.init forever.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from core import env
from ladder.errors import LadderError

REAP_GRACE_S = 5.0
_NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
STARTS = 3  # local starts before giving up when the node does not register in Ray's (fixed) 30 s
_NODE_LATE = "timed out during startup"


def ray_timeout_s(given: float | None = None) -> float:
    """--ray-timeout, else $MOE_LADDER_LIMITS ray_timeout_s, else 30; a positive finite number of seconds."""
    try:
        raw = given if given is not None else env.Limits.from_env().ray_timeout_s
    except env.EnvError as err:
        raise LadderError(str(err)) from None
    value = float(raw)
    if not 0 < value < 1e6:
        raise LadderError(f"the Ray connection timeout must be a positive number of seconds (got {raw})")
    return value


# ---- joining -------------------------------------------------------------------------------------
def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of "host:port" or "ray://host:port"; None for "auto" and other forms Ray resolves."""
    text = address.removeprefix("ray://").strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        return None
    if not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise LadderError(f"Ray address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def wait_reachable(address: str, timeout_s: float) -> None:
    """Return once address's host:port accepts a TCP connection; LadderError after timeout_s."""
    hp = host_port(address)
    if hp is None:
        return
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection(hp, timeout=min(5.0, left)):
                return
        except OSError as err:
            last = err
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    why = last.strerror or type(last).__name__ if last is not None else "timed out"
    raise LadderError(f"cannot reach Ray at {address} within {timeout_s:g} s ({why}); is its head node up? "
                      f"(--ray-timeout or $MOE_LADDER_LIMITS ray_timeout_s sets the wait)")


def check_ray_answers(address: str, timeout_s: float) -> None:
    """Return once address's host:port answers a Ray GCS call (GetClusterId over gRPC); LadderError
    when it answers otherwise or not within timeout_s. Ray Client addresses (ray://) and those Ray
    resolves itself ("auto") are left to ray.init."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    hp = host_port(address)
    if hp is None or address.strip().startswith("ray://"):
        return
    host, port = hp
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, wait_for_ready=True)
            return
        except grpc.RpcError as err:
            code = err.code()
            if code == grpc.StatusCode.UNAUTHENTICATED:
                return  # a GCS that wants a token: Ray, which ray.init will tell about
            why = "no answer" if code == grpc.StatusCode.DEADLINE_EXCEEDED else f"{code.name}: {err.details()}"
    raise LadderError(f"{address} accepts connections but does not answer as Ray within {timeout_s:g} s "
                      f"({' '.join(why.split())[:160]}); is it the head node's GCS port (default 6379)? "
                      f"(--ray-timeout or $MOE_LADDER_LIMITS ray_timeout_s sets the wait)")


def join(address: str, timeout_s: float, **kwargs) -> None:
    """ray.init(address) once the address has answered as Ray, all within timeout_s. A GCS answers
    before its node's raylet has registered, and ray.init gives up on a node that registers late
    (a loaded machine, a head just started): it is asked again until the deadline."""
    import ray

    deadline = time.monotonic() + timeout_s
    wait_reachable(address, timeout_s)
    check_ray_answers(address, max(deadline - time.monotonic(), 1.0))
    while True:
        try:
            ray.init(address=address, **kwargs)
            return
        except (RuntimeError, ConnectionError) as err:
            late = isinstance(err, ConnectionError) or "No node info found" in str(err)
            if not late or time.monotonic() > deadline:
                raise
            ray.shutdown()
            time.sleep(1.0)


# ---- local ---------------------------------------------------------------------------------------
class LocalRay:
    """ray.init of a fresh local instance on 127.0.0.1 with a reaper; shutdown() undoes it."""

    def __init__(self, num_cpus: int, **kwargs):
        import ray
        from ray._private import ray_constants

        self._env_before = os.environ.get(_NO_CLUSTER_ENV)
        self._cluster_before = ray_constants.ENABLE_RAY_CLUSTER
        os.environ[_NO_CLUSTER_ENV] = "0"  # the processes Ray starts read it at import
        ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray already
        for start in range(1, STARTS + 1):
            before = {pid for pid, _ in descendants(os.getpid())}
            try:
                ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
                break
            except BaseException as err:  # any failed start, Ctrl-C too: its processes go; retried or re-raised
                ray.shutdown()
                kill_new_ray_processes(before)
                late = isinstance(err, Exception) and _NODE_LATE in str(err)
                if late and start < STARTS:
                    logging.getLogger(__name__).warning("Ray's node did not register in time (start %d of %d); "
                                                        "starting it again", start, STARTS)
                    continue
                self._restore()
                if late:
                    raise RuntimeError(f"Ray's local node did not register within Ray's startup wait "
                                       f"in {STARTS} starts (a machine too busy?)") from err
                raise
        self.reaper = start_reaper(descendants(os.getpid()))

    def _restore(self) -> None:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = self._cluster_before
        if self._env_before is None:
            os.environ.pop(_NO_CLUSTER_ENV, None)
        else:
            os.environ[_NO_CLUSTER_ENV] = self._env_before

    def shutdown(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self._restore()
            if self.reaper is not None and self.reaper.stdin is not None:
                self.reaper.stdin.close()  # the reaper finds everything gone and exits


def proc_start(pid: int) -> str | None:
    """The kernel's start time of pid (clock ticks since boot), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[19]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below pid, from /proc (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").glob("[0-9]*"):
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(p.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        c = todo.pop()
        start = proc_start(c)
        if start is not None:
            out.append((c, start))
        todo.extend(children.get(c, []))
    return out


def kill(procs: list[tuple[int, str]]) -> list[int]:
    """SIGKILL each (pid, start time) still alive as that process (a reused pid is left alone); their pids."""
    killed = []
    for pid, start in procs:
        if proc_start(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def _is_ray(pid: int) -> bool:
    try:
        return b"ray" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def kill_new_ray_processes(before: set[int]) -> list[int]:
    """SIGKILL the Ray processes below this one that a failed start left (not in before); their pids."""
    return kill([(pid, start) for pid, start in descendants(os.getpid()) if pid not in before and _is_ray(pid)])


def start_reaper(procs: list[tuple[int, str]]) -> subprocess.Popen | None:
    if not procs:
        return None
    args = [f"{pid}:{start}" for pid, start in procs]
    return subprocess.Popen([sys.executable, "-m", "ladder.localray", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def reap(procs: list[tuple[int, str]], grace_s: float = REAP_GRACE_S) -> list[int]:
    """Wait for the driver's pipe to close, then kill the recorded processes still alive; their pids."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except (OSError, ValueError):
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(proc_start(pid) == start for pid, start in procs):
        time.sleep(0.2)
    return kill(procs)


def _main(argv: list[str]) -> None:
    procs = []
    for a in argv:
        pid, _, start = a.partition(":")
        procs.append((int(pid), start))
    reap(procs)


if __name__ == "__main__":
    _main(sys.argv[1:])
