"""One run of `ladder submit --local`, in its own process: reads its job (spec JSON, run dir, the
submission's root and owner, where to write the outcome) as JSON on stdin, trains with the same
claim / resume / status handling as a Ray worker (ladder.controller.train_task), and writes the
outcome record atomically to the file the job names."""

from __future__ import annotations

import json
import sys

from core.fsutil import atomic_write_json
from ladder.controller import train_task


def main() -> int:
    job = json.loads(sys.stdin.read())
    out = train_task(job["spec"], job["run_dir"], job["ctx"])
    atomic_write_json(job["out"], out)
    return 0 if out.get("outcome") in ("finished", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
