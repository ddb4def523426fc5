"""One run of `ladder submit --local`, in its own process: reads its job (spec JSON, run dir, the
submission's root and owner, where to write the outcome, the driver's pid) as JSON on stdin, trains
with the same claim / resume / status handling as a Ray worker (ladder.controller.train_task), and
writes the outcome record atomically to the file the job names.

The worker never outlives its driver: it gets SIGTERM when the driver dies (core/procs.py), which
stops the run at its next step as Ctrl-C does (status "interrupted", the claim released, the
checkpoints and metrics as they were). The outcome is written only while the driver that will read it is alive."""

from __future__ import annotations

import json
import os
import signal
import sys

from core.fsutil import atomic_write_json
from core.procs import die_with_parent
from ladder.controller import train_task


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def die_with_driver(driver: int) -> None:
    """SIGTERM, handled as Ctrl-C, to this process as soon as the driver `driver` is gone."""
    signal.signal(signal.SIGTERM, _interrupt)
    die_with_parent(driver, signal.SIGTERM)


def main() -> int:
    job = json.loads(sys.stdin.read())
    driver = int(job.get("driver", os.getppid()))
    try:
        die_with_driver(driver)
        out = train_task(job["spec"], job["run_dir"], job["ctx"])
    except KeyboardInterrupt:  # the driver died before training began
        out = {"outcome": "interrupted", "note": "the submission ended"}
    if os.getppid() != driver:  # no driver to read it
        return 1
    atomic_write_json(job["out"], out)
    return 0 if out.get("outcome") in ("finished", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
