"""Controller overhead on this machine.

1. A sweep of N short specs (default 20) through `ladder.controller.submit` on a local Ray:
   wall time of the sweep against the sum of the engines' own times (the time inside
   engine.train), per-run overhead, and the share of time the MLflow uploads took.
2. Resubmitting a finished sweep of M specs (default 100): `ladder submit` as a fresh process,
   which must train nothing and start no Ray.

    .venv/bin/python bench/controller_overhead.py [--specs 20] [--steps 30] [--resubmit-specs 100]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ladder.controller import submit

TINY = {"data.seq_len": 32, "data.batch_size": 4, "run.eval_every": 10**6, "run.eval_batches": 1}


def write_experiment(path: Path, name: str, n: int, steps: int) -> Path:
    base = {**TINY, "data.total_tokens": 32 * 4 * steps, "run.checkpoint_every": max(steps // 3, 1)}
    path.write_text(
        "from ladder.experiment import Experiment\nfrom ladder.presets import micro_spec\n"
        f"BASE = {base!r}\n"
        f"EXPERIMENT = Experiment(name={name!r}, rungs=tuple(micro_spec(f'r{{i:03d}}', seed=i, **BASE) for i in range({n})))\n"
    )
    return path


def sweep(tmp: Path, name: str, n: int, steps: int):
    from rich.console import Console

    path = write_experiment(tmp / f"{name}.py", name, n, steps)
    t0 = time.perf_counter()
    result = submit(path, root=tmp / ".ladder", console=Console(file=io.StringIO()))
    wall = time.perf_counter() - t0
    assert result.ok, result.outcomes
    return path, result, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--resubmit-specs", type=int, default=100)
    ap.add_argument("--resubmit-steps", type=int, default=5)
    ap.add_argument("--long-steps", type=int, default=400)
    args = ap.parse_args()
    os.environ.setdefault("MOE_LADDER_CACHE", tempfile.mkdtemp(prefix="moe-ladder-cache-"))
    cpus = os.cpu_count() or 1

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        import ray

        t0 = time.perf_counter()
        import logging

        ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        ray_start = time.perf_counter() - t0

        # warm the workers (imports of torch, the engine, mlflow) so the sweep measures steady state
        sweep(tmp, "warm", cpus, 3)
        _, result, wall = sweep(tmp, "bench", args.specs, args.steps)
        engine = [o["engine_s"] for o in result.outcomes.values()]
        concurrency = min(cpus, args.specs)
        print(f"machine: {cpus} CPU(s); local Ray start {ray_start:.1f}s (not in the figures below)")
        print(f"sweep of {args.specs} specs x {args.steps} steps, {concurrency} at a time:")
        print(f"  wall {wall:.1f}s, sum of engine times {sum(engine):.1f}s -> wall / sum = {wall / sum(engine):.2f}")
        ideal = sum(engine) / concurrency
        print(f"  ideal wall at {concurrency}-way parallelism {ideal:.1f}s -> controller overhead "
              f"{wall - ideal:.1f}s in all, {(wall - ideal) / args.specs * concurrency:.2f}s per run slot "
              f"({(wall / ideal - 1) * 100:.0f}% of the ideal)")
        print(f"  MLflow (the controller's pump thread, not the workers): {result.tracking_s:.2f}s, of which "
              f"opening runs {result.tracking_open_s:.2f}s = {result.tracking_open_s / args.specs:.3f}s a run")

        # steady-state price of tracking: one longer run, metric uploads only
        _, long, _ = sweep(tmp, "long", 1, args.long_steps)
        o = next(iter(long.outcomes.values()))
        upload = long.tracking_s - long.tracking_open_s
        per_step = o["engine_s"] / o["steps_run"]
        print(f"one run of {args.long_steps} steps: {per_step * 1e3:.1f} ms a step; the controller's metric uploads "
              f"{upload:.3f}s in all = {upload / o['steps_run'] * 1e3:.2f} ms of controller time a step "
              f"(0 ms in the training process); {upload / o['engine_s'] * 100:.1f}% of this tiny model's step, "
              f"< 2% of any step longer than {upload / o['steps_run'] * 50 * 1e3:.0f} ms")

        # the same, untracked: does tracking slow the training process down?
        from rich.console import Console

        bare = submit(write_experiment(tmp / "bare.py", "bare", 1, args.long_steps), root=tmp / ".ladder",
                      tracking=False, console=Console(file=io.StringIO()))
        ob = next(iter(bare.outcomes.values()))
        print(f"  the same spec untracked: {ob['engine_s'] / ob['steps_run'] * 1e3:.1f} ms a step "
              f"(tracked: {per_step * 1e3:.1f} ms; the difference is noise plus CPU the pump takes on a busy machine)")

        # a finished sweep of many specs, then resubmit it as a user would
        path, result, wall100 = sweep(tmp, "hundred", args.resubmit_specs, args.resubmit_steps)
        ray.shutdown()
        print(f"first run of the {args.resubmit_specs}-spec sweep ({args.resubmit_steps} steps each): {wall100:.1f}s")
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(tmp / ".ladder")],
            capture_output=True, text=True,
        )
        resub = time.perf_counter() - t0
        assert out.returncode == 0 and "nothing to train" in out.stderr, out.stderr
        print(f"resubmitting the finished {args.resubmit_specs}-spec sweep (`ladder submit`, a new process): {resub:.2f}s")
        from rich.console import Console

        t0 = time.perf_counter()
        submit(path, root=tmp / ".ladder", console=Console(file=io.StringIO()))
        print(f"  of which the ledger check (in-process submit): {time.perf_counter() - t0:.3f}s")


if __name__ == "__main__":
    main()
