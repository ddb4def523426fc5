"""One run of `ladder submit --local`, in its own process: reads its job (spec JSON, run dir, the
submission's root and owner, the pipe to write the outcome to, the driver's pid) as JSON on stdin,
trains with the same claim / resume / status handling as a Ray worker (ladder.worker.train_task),
and writes the outcome record to the pipe the job names, which its driver reads.

The worker never outlives its driver: it gets SIGTERM when the driver dies (core/procs.py), which
stops the run at its next step as Ctrl-C does (status "interrupted", the claim released, the
checkpoints and metrics as they were). Its outcome then goes nowhere: the pipe has no reader, so
nothing is left behind. (The kernel's parent-death signal comes when the driver's thread that
started the worker ends, and may come again as the driver's other threads end, while its pid still
looks alive to the worker; the pipe does not depend on that timing.)"""

from __future__ import annotations

import json
import os
import signal
import sys

from core.procs import die_with_parent
from ladder.worker import train_task

_interrupted = False


def _interrupt(signum, frame):
    global _interrupted
    if _interrupted:  # a second parent-death signal (see the module's docstring): stopping already
        return
    _interrupted = True
    raise KeyboardInterrupt(f"signal {signum}")


def die_with_driver(driver: int) -> None:
    """SIGTERM, handled as Ctrl-C, to this process as soon as the driver `driver` is gone."""
    signal.signal(signal.SIGTERM, _interrupt)
    die_with_parent(driver, signal.SIGTERM)


def hand_back(fd: int, out: dict) -> bool:
    """Write the outcome record to the driver's pipe; False when the driver is gone (no reader)."""
    data = json.dumps(out, allow_nan=True).encode()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BrokenPipeError:
        return False
    return True


def main() -> int:
    job = json.loads(sys.stdin.read())
    driver = int(job.get("driver", os.getppid()))
    fd = int(job["out_fd"])
    os.set_inheritable(fd, False)  # the engine's own subprocesses must not hold the driver's pipe open
    try:
        die_with_driver(driver)
        out = train_task(job["spec"], job["run_dir"], job["ctx"])
    except KeyboardInterrupt:  # the driver died before training began
        out = {"outcome": "interrupted", "note": "the submission ended"}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ending anyway: a late signal changes nothing
    if not hand_back(fd, out):
        return 1
    return 0 if out.get("outcome") in ("finished", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
