"""`ladder submit --local`: an experiment's runs one after another in subprocesses on this machine,
without Ray. For a single GPU workstation, or a GPU box where Ray is not installed.

Same ledger as the Ray controller: the same run directories, claims (a second submission, local or
Ray, waits for or skips a spec this one holds), resume from the newest checkpoint, the same MLflow
mirror of each run dir, and the same progress display (read from each run's metrics.jsonl).

Each run is `python -m ladder.local_worker` in its own process, so a crash, a CUDA error or an
out-of-memory kill ends that run alone; its output goes to run_dir/worker.log, its outcome record
comes back through a pipe (never a file: a worker whose driver is gone has no one to hand it to,
and leaves nothing behind). Ctrl-C asks the running worker to stop at its next step (the ledger's
stop marker), as the Ray controller does; a driver killed outright takes its worker with it
(ladder/local_worker.py: die_with_driver).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.rundir import RunDir
from ladder import ledger

POLL_S = 0.5
STOP_GRACE_S = 30.0
WORKER_LOG = "worker.log"


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def local_gpus(driver_dir: Path = NVIDIA_GPUS, env: dict | None = None) -> int:
    """The CUDA devices a process started here would see, counted without importing a framework
    (importing torch costs a CLI command seconds): the NVIDIA driver's GPUs (one folder each in
    driver_dir; where the driver publishes none there, the lines of `nvidia-smi -L`), cut to
    CUDA_VISIBLE_DEVICES where it is set (CUDA reads it up to its first empty or negative entry)."""
    env = os.environ if env is None else env
    try:
        n = len(list(driver_dir.iterdir()))
    except OSError:
        n = _nvidia_smi_gpus()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return n
    named = 0
    for entry in visible.split(","):
        if not entry.strip() or entry.strip().startswith("-"):
            break
        named += 1
    return min(n, named)


def _nvidia_smi_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # a driver that does not answer offers no GPU
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def infeasible(specs: list, gpus: int, cpus: int) -> list[str]:
    """Why each spec cannot run on this machine (one line each; empty when all can)."""
    out = []
    for s in specs:
        if s.hardware.task_gpus > gpus:
            out.append(f"spec {s.name} ({s.id}) asks for {s.hardware.task_gpus:g} GPU per run; this machine has {gpus}")
        if s.hardware.task_cpus > cpus:
            out.append(f"spec {s.name} ({s.id}) asks for {s.hardware.task_cpus:g} CPU per run; this machine has {cpus}")
    return out


def _progress(run_dir: Path, pid: int) -> dict | None:
    rec = RunDir(run_dir).last_metrics()
    if rec is None or not isinstance(rec.get("step"), int):
        return None
    return {"step": rec["step"] + 1, "loss": rec.get("loss"), "tokens_per_s": rec.get("tokens_per_s"),
            "host": socket.gethostname(), "pid": pid}


def _attempt(run_dir: Path, pid: int) -> dict | None:
    """The attempts.jsonl record of worker `pid` (written as it starts, with its resume step), if there yet."""
    try:
        lines = (run_dir / "attempts.jsonl").read_bytes().splitlines()[-20:]
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("pid") == pid and isinstance(rec.get("step"), int):
            return rec
    return None


def _failed(p, note: str) -> dict:
    return {"spec_id": p.spec.id, "name": p.spec.name, "outcome": "failed", "note": note}


def _log_tail(path: Path, n: int = 3) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-300:]


def _drain(fd: int, buf: bytearray) -> None:
    """Append what the pipe `fd` (non-blocking) holds now to `buf`."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            return
        buf += chunk


def run_one(p, ctx: dict, display, mirror) -> dict:
    """Train one planned spec in a worker subprocess; returns the worker's outcome record."""
    p.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = p.run_dir / WORKER_LOG
    out_r, out_w = os.pipe()  # the worker writes its outcome record here as it ends
    os.set_blocking(out_r, False)
    job = {"spec": p.spec.model_dump_json(), "run_dir": str(p.run_dir), "ctx": ctx, "out_fd": out_w,
           "driver": os.getpid()}
    started, got = False, bytearray()
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "ladder.local_worker"], stdin=subprocess.PIPE,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), pass_fds=(out_w,))
            os.close(out_w)
            out_w = -1
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
            try:
                shown = False
                while proc.poll() is None:
                    _drain(out_r, got)
                    if not shown:  # "running ... from step N": the step it resumes from, not the first seen
                        att = _attempt(p.run_dir, proc.pid)
                        if att is not None:
                            display.update(p.spec.id, {"step": att["step"], "host": att.get("host"), "pid": proc.pid})
                            shown = True
                    upd = _progress(p.run_dir, proc.pid) if shown else None
                    if upd is not None:
                        if not started and mirror is not None:
                            mirror.started(p)
                        started = True
                        display.update(p.spec.id, upd)
                    time.sleep(POLL_S)
            except KeyboardInterrupt:
                ledger.request_stop(ctx["root"], ctx["owner"])
                try:
                    proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.terminate()
                    proc.wait(timeout=15)
                finally:
                    ledger.clear_stop(ctx["root"], ctx["owner"])
                raise
        _drain(out_r, got)  # the worker wrote it whole before it exited
        try:
            out = json.loads(bytes(got))
        except ValueError:
            out = None
        if not isinstance(out, dict):
            out = _failed(p, f"worker exited with status {proc.returncode} (see {log_path}): {_log_tail(log_path)}")
        return out
    finally:
        os.close(out_r)
        if out_w >= 0:
            os.close(out_w)


def dispatch_local(todo: list, ctx: dict, result: Any, display, mirror) -> None:
    """Run `todo` one after another; a spec another submission holds is waited for once the
    others are done, then skipped if that submission finished it."""
    queue = list(todo)
    waited: set[str] = set()
    while queue:
        p = queue.pop(0)
        holder = ledger.live_claim(p.run_dir, p.spec.id)
        if holder is not None and holder.get("owner") != ctx["owner"]:
            display.waiting(p.spec.id, f"held by another submission ({holder.get('host')} pid {holder.get('pid')}); waiting")
            if queue or p.spec.id not in waited:
                waited.add(p.spec.id)
                queue.append(p)
                if not queue[:-1]:
                    time.sleep(5 * POLL_S)
                continue
        if ledger.is_finished(p.run_dir, p.spec):
            out = {"spec_id": p.spec.id, "name": p.spec.name, "outcome": "skipped", "note": "finished by another submission"}
        else:
            out = run_one(p, ctx, display, mirror)
            if out.get("outcome") == "busy":
                queue.append(p)
                continue
        result.outcomes[p.spec.id] = out
        if mirror is not None:
            if out["outcome"] == "skipped":
                mirror.adopt(p)
            else:
                mirror.ended(p, out["outcome"])
        bits = [f"loss {out['loss']:.4f}"] if out.get("loss") is not None else []
        if out.get("note"):
            bits.append(str(out["note"])[:160])
        display.done(p.spec.id, out["outcome"], "  ".join(bits))
