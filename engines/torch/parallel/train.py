"""Train a spec over processes on a (data x expert) layout: FSDP2 shards, the layout's dispatcher
for the experts, the one forward (engines/torch/parallel/step.py).

    torchrun --standalone --nproc_per_node N -m engines.torch.parallel.train SPEC.yaml --run-dir DIR
             [--steps S] [--options OPTIONS.json]

N = dp * model.ep_size processes (engines/torch/parallel/layout.py; dp = 1 is expert parallel
alone); GPUs with NCCL (rank i on cuda:LOCAL_RANK), else CPU processes with gloo (--device cpu
forces it). --steps S stops after step S of the schedule (the LR still follows the whole
schedule) with a checkpoint, so a later call continues. Exit codes: 0 done, 2 bad input or
layout (one line on stderr), 3 diverged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from pydantic import ValidationError

from core.spec import Spec, SpecError, format_validation_error, load_spec
from engines.base import DivergedError, StepMetrics
from engines.checkpoint import CheckpointError
from engines.data import DataError
from engines.options import EngineOptions, Options
from engines.torch.parallel.launch import die_with_parent
from engines.torch.parallel.layout import Layout, LayoutError, check_layout, setup_layout
from engines.torch.parallel.step import train_layout


def read_args(spec_path: Path, steps: int | None) -> Spec | None:
    """The spec of `spec_path`, or None after one line on stderr naming what is wrong with it or
    with --steps."""
    try:
        spec = load_spec(spec_path)
    except ValidationError as err:
        print(f"error: invalid spec: {format_validation_error(err)}", file=sys.stderr)
        return None
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
    if steps is not None and steps < 1:
        print(f"error: --steps must be >= 1 (got {steps})", file=sys.stderr)
        return None
    return spec


def drive(spec: Spec, run_dir: Path, records: Iterable[StepMetrics], *, lead: bool, where: str,
          errors: tuple[type[Exception], ...], barrier: Callable[[], None], log_every: int,
          after_step: Callable[[], None] | None = None) -> int:
    """Run a rank's training to its exit code: the lead prints a line every log_every steps and a
    last one; `errors` (bad input, layout, checkpoints, data) give 2 with one line, divergence 3.
    Every rank reaches the barrier together at the end: a gloo rank whose peer has already closed
    its connections can abort in its transport thread ("terminate called without an active
    exception"). The process group is destroyed whatever happened."""
    code = 0
    try:
        last = None
        for rec in records:
            last = rec
            if after_step is not None:
                after_step()
            if lead and rec.step % log_every == 0:
                print(f"step {rec.step}/{spec.total_steps} loss {rec.loss:.4f} drops {rec.drop_frac_send:.4f}/"
                      f"{rec.drop_frac_recv:.4f} {rec.tokens_per_s:,.0f} tok/s", flush=True)
        if lead:
            print(f"{spec.name}: nothing to do ({run_dir})" if last is None else
                  f"{spec.name}: step {last.step + 1}/{spec.total_steps} on {where}, loss {last.loss:.4f}"
                  f" -> {run_dir}", flush=True)
        barrier()
    except errors as err:
        # every rank says it: the first rank to exit has torchrun stop the others, the lead perhaps
        # before it could print
        print(f"error: {err}", file=sys.stderr, flush=True)
        code = 2
    except DivergedError as err:
        # every rank reads the same all-reduced loss, so all of them stop at this step; they meet
        # once more so that no rank's exit (torchrun then stops the others) cuts the lead off
        # before status.json says "diverged"; a peer already gone (its own exit) fails the barrier
        # (torch.distributed's errors are RuntimeErrors), and the run is diverged all the same
        try:
            barrier()
        except RuntimeError as gone:
            print(f"note: a peer left before the divergence barrier ({str(gone).splitlines()[0][:200]})",
                  file=sys.stderr, flush=True)
        if lead:
            print(f"diverged: {err}", file=sys.stderr)
        code = 3
    finally:
        dist.destroy_process_group()
    return code


def exit_now(code: int) -> None:
    """Leave without the interpreter's finalisation: after a complete run (metrics, status and
    checkpoints written atomically, the process group destroyed) a gloo rank could still abort
    there ("terminate called without an active exception", exit -6), its transport's worker
    threads torn down with the interpreter, which failed the whole launch."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class StepProfiler:
    """torch.profiler over steps 3 and 4 of this launch (compilation is over by then); the rank's
    operator table, by device time and by host time, goes to PREFIX.rank<r>.txt."""

    FIRST, STEPS = 2, 2

    def __init__(self, prefix: Path, layout: Layout):
        self.prefix, self.layout, self.seen, self.prof, self.t0 = prefix, layout, 0, None, 0.0

    def after_step(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.seen += 1
        cuda = self.layout.device.type == "cuda"
        if self.seen == self.FIRST:
            self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.prof is not None and self.seen == self.FIRST + self.STEPS:
            if cuda:
                torch.cuda.synchronize(self.layout.device)
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            avg = self.prof.key_averages()
            dev_key = "self_device_time_total" if cuda else "self_cpu_time_total"
            text = (f"rank {self.layout.rank}: {1e3 * wall / self.STEPS:.1f} ms per step over {self.STEPS} steps\n\n"
                    f"by {dev_key}:\n{avg.table(sort_by=dev_key, row_limit=40)}\n\n"
                    f"by self_cpu_time_total:\n{avg.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
            self.prefix.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{self.prefix}.rank{self.layout.rank}.txt").write_text(text)
            self.prof = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.torch.parallel.train", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", type=Path, help="spec file (.yaml or .json)")
    p.add_argument("--run-dir", type=Path, required=True, help="where metrics, status and checkpoints go")
    p.add_argument("--steps", type=int, default=None, help="stop after this step of the schedule")
    p.add_argument("--no-resume", action="store_true", help="start over, discarding this run dir's checkpoints")
    p.add_argument("--no-checkpoints", action="store_true", help="write no checkpoints (benchmarks)")
    p.add_argument("--options", type=Path, default=None, metavar="FILE",
                   help="engine options as JSON (EngineOptions.to_dict); default: the spec's, $MOE_LADDER_OPTIONS on top")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if present")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints a line every this many steps")
    p.add_argument("--profile", type=Path, default=None, metavar="PREFIX",
                   help="torch.profiler over two steps after the first two; each rank writes PREFIX.rank<r>.txt")
    args = p.parse_args(argv)
    spec = read_args(args.spec, args.steps)
    if spec is None:
        return 2
    try:
        # a command line of its own: the spec's options with the environment's on top, as `ladder train`
        options = (EngineOptions.from_dict(json.loads(args.options.read_text())) if args.options
                   else EngineOptions.for_spec(spec, Options.from_env()))
    except (OSError, ValueError, TypeError) as err:
        print(f"error: --options {args.options}: {err}" if args.options else f"error: {err}", file=sys.stderr)
        return 2
    die_with_parent()  # a rank whose launcher is gone stops too
    try:
        # the layout first: a wrong process count is reported before any rendezvous
        check_layout(spec.model, int(os.environ.get("WORLD_SIZE", "1")), spec.data.batch_size)
        layout = setup_layout(spec.model, spec.data.batch_size, args.device)
    except LayoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prof = StepProfiler(args.profile, layout) if args.profile else None
    records = train_layout(spec, args.run_dir, layout, resume=not args.no_resume, stop_after=args.steps,
                           checkpoints=not args.no_checkpoints, options=options)
    return drive(spec, args.run_dir, records, lead=layout.rank == 0, where=f"{layout.dp} x {layout.ep} (data x expert)",
                 errors=(LayoutError, CheckpointError, DataError), barrier=dist.barrier, log_every=args.log_every,
                 after_step=prof.after_step if prof is not None else None)


if __name__ == "__main__":
    exit_now(main())  # no gloo teardown in the interpreter's finalisation
