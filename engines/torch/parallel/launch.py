"""The launcher follows the layout: a spec trains in process on one device (1 x 1, the engine's
own step; an ep_size > 1 spec there has its shards emulated), in model.ep_size processes under
torchrun on one host (dp = 1: engines/torch/parallel/train.py, one process per GPU, NCCL), or
across hosts under Ray Train (ladder/train_launch.py: spec.hardware.workers processes, dp =
workers / ep). The JAX engine does the same in one process over a device mesh.

`ladder train` and the controller's Ray workers get the torchrun launch through
TorchEngine.train, which yields the StepMetrics that rank 0 appends to metrics.jsonl as they land.
EngineOptions.torch_ep (a spec's options.torch_ep, or $MOE_LADDER_OPTIONS torch_ep) picks the layout on one host: "auto" (processes
where the GPUs are there, else emulated), "emulate" (always one device) or "processes" (always;
gloo CPU processes where there is no GPU).

The child group is the run's only writer: the checkpoints, status.json and metrics.jsonl are the
ranks', so a resumed or replayed run is the same whichever launched it. Closing the generator (a
cancelled Ray task, Ctrl-C) ends the whole process group; a launcher that dies without closing it
(a SIGKILLed Ray worker) takes the group with it too, through the kernel's parent-death signal
(Linux), so a retry never meets a second writer.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import torch

import engines
from engines.base import METRICS_FILE, DivergedError, StepMetrics, emulated_ep_note, read_status
from engines.checkpoint import latest_checkpoint, missing_parent_checkpoint, resume_step
from engines.options import EngineOptions
from engines.torch.parallel.sharded import latest_sharded
from engines.torch.parallel.layout import NO_MULTICAST, LayoutError
from core.fsutil import atomic_write_json, atomic_write_text
from core.rundir import parse_metrics_lines
from core.spec import Spec

SPEC_FILE = "ep_spec.json"
OPTIONS_FILE = "ep_options.json"
LOG_FILE = "ep_launch.log"
RENDEZVOUS_FILE = "ep_rendezvous"  # torchrun's agent meets here while the ranks run
POLL_S = 0.2
# Run before torchrun, in its own process: the parent-death signal survives exec, and setting it
# here rather than in a preexec_fn keeps Python code out of the window between fork and exec
# (where a lock held by another of the launcher's threads, a Ray worker's, could deadlock it).
# It exits if the launcher is gone already, which the signal would no longer report.
EXEC_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
                    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])")


# One host: nothing listens beyond 127.0.0.1. torchrun's --standalone rendezvous hosts two TCPStores
# in its agent, listening on every interface; instead the agent meets in a file, shares no store
# (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and hands the ranks 127.0.0.1 (--local-addr), where rank 0
# hosts the process group's store bound to that address (layout.loopback_store). gloo's own
# sockets go on the loopback interface too (it would take the address the host name resolves to).
def loopback_env(device: torch.device) -> dict[str, str]:
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if device.type != "cuda" and "GLOO_SOCKET_IFNAME" not in os.environ and \
            any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def loopback_rendezvous(path: str) -> list[str]:
    """torchrun's rendezvous arguments for one host meeting in the file `path`."""
    return ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-conf", "store_type=file", "--rdzv-endpoint", path,
            "--rdzv-id", uuid.uuid4().hex, "--local-addr", "127.0.0.1"]


def use_processes(spec: Spec, device: torch.device, options: EngineOptions) -> bool:
    """Whether this spec trains in model.ep_size processes rather than on one device."""
    how = options.torch_ep
    if spec.model.ep_size <= 1 or how == "emulate":
        return False
    if how == "processes":
        return True
    return device.type == "cuda" and torch.cuda.device_count() >= spec.model.ep_size


def emulation_warning(spec: Spec, device: torch.device, options: EngineOptions) -> str | None:
    """What to tell a user whose expert-parallel spec will run on one GPU with the shards
    emulated (the results are the same; the experts' memory is not split)."""
    ep = spec.model.ep_size
    if ep <= 1 or device.type != "cuda" or use_processes(spec, device, options):
        return None
    n = torch.cuda.device_count()
    why = "options torch_ep=emulate" if options.torch_ep == "emulate" else f"{n} GPU(s) visible"
    return emulated_ep_note(spec.name, ep, why)


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing). Each rank calls it as it starts."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _read_new(path: Path, offset: int, start: int, since: float) -> tuple[list[StepMetrics], int]:
    """This launch's complete records after byte `offset`, and the offset after them.

    The file may still hold an earlier launch's records until rank 0's writer truncates it
    (atomically, to the records below its resume step `start`): records below `start` are
    passed over, and one at or past `start` that finished before this launch (`since`) stops the
    read without moving the offset, so it is read again from the truncated file."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    recs = []
    for line in chunk[: chunk.rfind(b"\n") + 1].splitlines(keepends=True):  # a torn last record waits
        got = parse_metrics_lines(line, path, warn=None)
        if not got and line.strip():  # a bad line: say where (counting lines only then)
            with open(path, "rb") as f:
                parse_metrics_lines(line, path, first_line=f.read(offset).count(b"\n") + 1)
        rec = got[0] if got else None
        if rec is not None and rec.get("step", -1) >= start:
            if rec["time"] < since:
                break
            recs.append(StepMetrics.from_dict(rec))
        offset += len(line)
    return recs, offset


def train_processes(spec: Spec, run_dir: Path, resume: bool, device: torch.device,
                    options: EngineOptions) -> Iterator[StepMetrics]:
    """Run engines/torch/parallel/train.py over model.ep_size processes (dp = 1, under `options`)
    and yield each step's record as rank 0 writes it."""
    ep = spec.model.ep_size
    metrics = run_dir / METRICS_FILE
    ckpt = latest_checkpoint(run_dir) if resume else None
    sharded = latest_sharded(run_dir) if resume else None
    if ckpt is None and sharded is None and spec.lineage.resume_step is not None:
        raise missing_parent_checkpoint(spec, run_dir)  # as the one-process engine: never start over
    # where the ranks resume: the newest of their sharded checkpoints and the intact engine-neutral ones
    found = ([resume_step(run_dir)] if ckpt is not None else []) + ([int(sharded.name[5:])] if sharded else [])
    start = max(found, default=0)
    offset, since = 0, time.time()
    spec_path = run_dir / SPEC_FILE
    atomic_write_text(spec_path, spec.model_dump_json(indent=1))
    options_path = atomic_write_json(run_dir / OPTIONS_FILE, options.to_dict())
    rdzv = run_dir / RENDEZVOUS_FILE  # the agent's rendezvous, a file: no port
    rdzv.unlink(missing_ok=True)  # a killed launch's
    cmd = ["-m", "torch.distributed.run", *loopback_rendezvous(str(rdzv)), "--nproc_per_node", str(ep),
           "-m", "engines.torch.parallel.train", str(spec_path), "--run-dir", str(run_dir), "--options", str(options_path),
           "--device", "cuda" if device.type == "cuda" else "cpu", "--log-every", str(10**9)]
    if not resume:
        cmd.append("--no-resume")
    if sys.platform.startswith("linux"):  # torchrun dies with this process (PR_SET_PDEATHSIG)
        cmd = [sys.executable, "-c", EXEC_WITH_PARENT, str(os.getpid()), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    root = str(Path(engines.__file__).resolve().parents[1])
    env = dict(os.environ, **NO_MULTICAST, **loopback_env(device),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    log_path = run_dir / LOG_FILE
    try:
        with open(log_path, "ab") as log:
            log_start = log.tell()
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except BaseException:
        rdzv.unlink(missing_ok=True)
        raise
    try:
        while True:
            done = proc.poll() is not None
            recs, offset = _read_new(metrics, offset, start, since)
            yield from recs
            if done:
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            _stop(proc)
        rdzv.unlink(missing_ok=True)
    if proc.returncode == 0:
        return
    # torchrun reports any failed rank as exit 1: what failed is in the ranks' status and log
    with open(log_path, "rb") as f:
        f.seek(log_start)
        log_text = f.read().decode(errors="replace")
    status = read_status(run_dir)
    if status.get("state") == "diverged":
        last, how = status.get("last_checkpoint"), status.get("last_checkpoint_is")
        where = (f"the newest checkpoint is {last} ({how}); rerun it on purpose with --rerun-diverged" if last
                 else "no checkpoint was written")
        raise DivergedError(f"loss became {status.get('loss')} (grad norm {status.get('grad_norm')}) at step "
                            f"{status.get('step')}; {where}")
    refused = [line[len("error: "):] for line in log_text.splitlines() if line.startswith("error: ")]
    if refused:
        raise LayoutError(f"{refused[-1]} (expert-parallel run, log: {log_path})")
    raise RuntimeError(f"expert-parallel run exited {proc.returncode} (log: {log_path}):\n{log_text[-3000:]}")


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to the launcher's whole group (torchrun and its ranks), SIGKILL after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
