"""The torch engine's real expert parallel: a spec with model.ep_size > 1 on a machine with at
least ep_size GPUs trains in ep_size processes (engines/torch/ep_train.py under torchrun, one
process per GPU, NCCL), not on one device with the shards emulated. The JAX engine does the same
in one process over a device mesh.

`ladder train` and the controller's Ray workers get it through TorchEngine.train, which yields
the StepMetrics that rank 0 appends to metrics.jsonl as they land. $MOE_LADDER_TORCH_EP picks
the layout: "auto" (processes where the GPUs are there, else emulated), "emulate" (always one
device) or "processes" (always; gloo CPU processes where there is no GPU).

The child group is the run's only writer: the checkpoints, status.json and metrics.jsonl are
ep_train's, so a resumed or replayed run is the same whichever launched it. Closing the
generator (a cancelled Ray task, Ctrl-C) ends the whole process group; a launcher that dies
without closing it (a SIGKILLed Ray worker) takes the group with it too, through the kernel's
parent-death signal (Linux), so a retry never meets a second writer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

import engines
from engines.base import METRICS_FILE, DivergedError, StepMetrics, truncate_metrics
from engines.checkpoint import latest_checkpoint, missing_parent_checkpoint
from engines.torch.ep import NO_MULTICAST, EPError
from ladder.fsutil import atomic_write_text
from ladder.spec import Spec

LAYOUTS = ("auto", "emulate", "processes")
SPEC_FILE = "ep_spec.json"
LOG_FILE = "ep_launch.log"
POLL_S = 0.2


def layout() -> str:
    value = os.environ.get("MOE_LADDER_TORCH_EP", "auto")
    if value not in LAYOUTS:
        raise EPError(f"MOE_LADDER_TORCH_EP={value!r}: choose one of {', '.join(LAYOUTS)}")
    return value


def use_processes(spec: Spec, device: torch.device) -> bool:
    """Whether this spec trains in model.ep_size processes rather than on one device."""
    how = layout()
    if spec.model.ep_size <= 1 or how == "emulate":
        return False
    if how == "processes":
        return True
    return device.type == "cuda" and torch.cuda.device_count() >= spec.model.ep_size


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the thread that started it ends (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _read_new(path: Path, offset: int) -> tuple[list[StepMetrics], int]:
    """Complete records appended after byte `offset`, and the offset after them."""
    import json

    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1  # a record still being written waits for the next poll
    recs = [StepMetrics.from_dict(json.loads(line)) for line in chunk[:end].decode().splitlines() if line.strip()]
    return recs, offset + end


def train_processes(spec: Spec, run_dir: Path, resume: bool, device: torch.device) -> Iterator[StepMetrics]:
    """Run ep_train over model.ep_size processes and yield each step's record as rank 0 writes it."""
    ep = spec.model.ep_size
    metrics = run_dir / METRICS_FILE
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is None and spec.lineage.resume_step is not None:
        raise missing_parent_checkpoint(spec, run_dir)  # as the one-process engine: never start over
    # what ep_train's own writer keeps (records below its resume step), so the records after
    # this offset are this launch's
    truncate_metrics(metrics, int(ckpt.name.split("_")[-1]) if ckpt is not None else 0)
    offset = metrics.stat().st_size if metrics.exists() else 0
    spec_path = run_dir / SPEC_FILE
    atomic_write_text(spec_path, spec.model_dump_json(indent=1))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ep),
           "-m", "engines.torch.ep_train", str(spec_path), "--run-dir", str(run_dir),
           "--device", "cuda" if device.type == "cuda" else "cpu", "--log-every", str(10**9)]
    if not resume:
        cmd.append("--no-resume")
    root = str(Path(engines.__file__).resolve().parents[1])
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with open(run_dir / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
    try:
        while True:
            done = proc.poll() is not None
            recs, offset = _read_new(metrics, offset)
            yield from recs
            if done:
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            _stop(proc)
    if proc.returncode == 0:
        return
    tail = (run_dir / LOG_FILE).read_text(errors="replace")[-3000:]
    if proc.returncode == 3:
        raise DivergedError(f"expert-parallel run diverged ({run_dir / LOG_FILE}):\n{tail}")
    if proc.returncode == 2:
        raise EPError(f"expert-parallel run refused its input ({run_dir / LOG_FILE}):\n{tail}")
    raise RuntimeError(f"expert-parallel run exited {proc.returncode} ({run_dir / LOG_FILE}):\n{tail}")


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
