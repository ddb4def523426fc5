"""Forked torch.distributed ranks on this machine, for the CPU tests of the multi-process engines.

    python -m tests.engines.fork_ranks MODULE JOBS_JSON JOIN_S

runs each job [world, argv] of JOBS_JSON in turn: `world` forked processes, each with the
torchrun environment of its rank (127.0.0.1, a free port) calling MODULE.main(argv). A rank still
alive after JOIN_S seconds is killed. It prints `CODES [[exit codes of job 1], ...]`. Forking one
parent that has imported torch (and torch._dynamo, which AdamW imports lazily: seconds) saves
each rank that import. A job [world, argv, env] sets `env` in its ranks' environment on top of the
driver's (another $MOE_LADDER_OPTIONS); a job ["call", "module:function", args] calls function(*args)
in the driver itself between two jobs (an export of what an earlier job wrote, for a later one to
read), its code "called"; an exception there fails the driver. Both let one driver, one torch
import, serve what would otherwise take several.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cpu_env(options: str = "cpu_threads=1") -> dict:
    """The environment of a rank process: one thread each (ranks share the cores), the repo
    importable, $MOE_LADDER_OPTIONS `options`."""
    return dict(os.environ, OMP_NUM_THREADS="1", MOE_LADDER_OPTIONS=options, PYTHONPATH=str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(module: str, jobs: list, join_s: int, timeout: int, options: str = "cpu_threads=1") -> list[list[int]]:
    """Runs the jobs in one driver process; each job's exit codes (the process must itself succeed)."""
    proc = subprocess.run([sys.executable, "-m", "tests.engines.fork_ranks", module, json.dumps(jobs), str(join_s)],
                          cwd=ROOT, env=cpu_env(options), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("CODES "))[6:])


def _rank(main, rank: int, world: int, port: int, argv: list[str], env: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    os._exit(main(argv))


def run_jobs(module: str, jobs: list, join_s: int) -> list[list[int]]:
    import torch._dynamo  # noqa: F401  (see the module's docstring)

    main = importlib.import_module(module).main
    codes = []
    for job in jobs:
        if job[0] == "call":
            mod, _, fn = job[1].partition(":")
            getattr(importlib.import_module(mod), fn)(*job[2])
            codes.append("called")
            continue
        world, argv, env = job[0], job[1], (job[2] if len(job) > 2 else {})
        port = free_port()
        procs = [mp.get_context("fork").Process(target=_rank, args=(main, r, world, port, argv, env))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_s)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        codes.append([p.exitcode for p in procs])
    return codes


if __name__ == "__main__":
    print("CODES " + json.dumps(run_jobs(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
