"""What the multi-process entry points (engines/torch/ep_train.py, engines/torch/dist/train.py)
share around their training loop: the spec argument and --steps checked in one line each, a
rank's run driven to its exit code (0 done, 2 bad input or layout, 3 diverged; the lead rank
prints), and the process left without the interpreter's finalisation."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch.distributed as dist
from pydantic import ValidationError

from core.spec import Spec, SpecError, format_validation_error, load_spec
from engines.base import DivergedError, StepMetrics


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
        if lead:
            print(f"error: {err}", file=sys.stderr)
        code = 2
    except DivergedError as err:
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
