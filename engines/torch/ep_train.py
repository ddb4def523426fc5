"""Train a spec with expert parallel over model.ep_size processes (one per device).

    torchrun --standalone --nproc_per_node EP -m engines.torch.ep_train SPEC.yaml --run-dir DIR [--steps N]
             [--options OPTIONS.json]   (engines/options.EngineOptions; default: from the environment)

GPUs with NCCL (rank i on cuda:LOCAL_RANK), else CPU processes with gloo (--device cpu forces
it). Every rank computes the same global metrics; rank 0 writes run_dir/metrics.jsonl (the
StepMetrics records of the single-device engine: loss, drops, loads and entropy over the whole
step; tokens and tokens/s of all ranks; MFU against ep_size devices), status.json, the
checkpoints (engine-neutral: the experts gathered from every rank, so `ladder train` or the JAX
engine can continue the run, and this entry point resumes from either engine's checkpoints)
and ep.json (the layout: experts and memory per rank, collectives made).

--steps N stops after step N of the schedule (the LR still follows the whole schedule) with a
checkpoint, so a later call continues. Exit codes: 0 done, 2 bad input or layout (message on
stderr), 3 diverged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from core.fsutil import atomic_write_json
from core.spec import Spec
from engines.base import StepMetrics
from engines.checkpoint import CheckpointError
from engines.data import DataError, TokenStream
from engines.options import EngineOptions
from engines.torch.engine import (
    METRIC_KEYS,
    build_optimizer,
    cpu_threads,
    dispatcher_name,
    optimizer_from_numpy,
    optimizer_to_numpy,
    queue_update,
    read_step,
)
from engines.torch.ep_launch import die_with_parent
from engines.torch.ep import (
    Counters,
    EPContext,
    EPError,
    EPLoss,
    build_local_model,
    check_layout,
    gather_experts,
    is_expert_param,
    load_local,
    local_slice,
    reduce_and_clip,
    setup_from_env,
    step_metrics,
)
from engines.torch.experts import kernels_here
from engines.torch.model import init_params
from engines.torch.rank_main import drive, exit_now, read_args
from engines.trainer import Trainer

ENGINE_NAME = "torch"
SUMMARY_FILE = "ep.json"


def _shard(batch_BS1: np.ndarray, ctx: EPContext, what: str) -> np.ndarray:
    B = batch_BS1.shape[0]
    if B % ctx.size:
        raise EPError(f"the {what} has {B} sequences, not a multiple of model.ep_size ({ctx.size})")
    b = B // ctx.size
    return batch_BS1[ctx.rank * b: (ctx.rank + 1) * b]


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class EPStep:
    """The expert-parallel step module (engines/trainer.py): this rank's experts, the pooled-wave
    all-to-all between ranks, gradients all-reduced; every rank computes the same global values.
    Each step is read before the next is launched (its collectives already synchronise)."""

    engine = ENGINE_NAME
    lookahead = False
    synchronous = False

    def __init__(self, spec: Spec, ctx: EPContext, run_dir: Path, options: EngineOptions):
        self.spec, self.ctx, self.run_dir, self.options = spec, ctx, run_dir, options
        self.lead = ctx.rank == 0
        self.devices = ctx.size
        self.model = build_local_model(spec.model, ctx)
        self.opt = build_optimizer(self.model, spec, working=False)  # its own sharded loss reads the fp32 masters
        self.loss_fn = EPLoss(self.model, ctx, kernels_here(options.torch_kernels))

    def init_fresh(self) -> None:
        load_local(self.model, init_params(self.spec.model, self.spec.seed), self.ctx)

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        load_local(self.model, params, self.ctx)
        optimizer_from_numpy(self.model, self.opt, local_slice(opt, self.spec.model, self.ctx))

    def save_arrays(self) -> tuple[dict, dict] | None:
        full_params = gather_experts(self.model.to_numpy(), self.ctx)
        full_opt = gather_experts(optimizer_to_numpy(self.model, self.opt), self.ctx)
        return (full_params, full_opt) if self.lead else None

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        spec, model, opt, ctx = self.spec, self.model, self.opt, self.ctx
        n_tok = batch_BS1.shape[0] * (batch_BS1.shape[1] - 1)
        x = torch.from_numpy(_shard(batch_BS1, ctx, f"batch of step {step}")).to(ctx.device, dtype=torch.long)
        for g in opt.param_groups:
            g["lr"] = lr
        total_r, out = self.loss_fn(model, x, spec.optim, n_tok)
        total_r.backward()
        grad_norm, sums = reduce_and_clip(model, ctx, spec.optim.grad_clip,
                                          torch.stack([out["aux_r"], out["total_r"]]).float())
        metrics = step_metrics(out, sums[0], sums[1])
        vals = torch.stack([metrics[k].float() for k in METRIC_KEYS] + [grad_norm.float()])
        return queue_update(model, opt, vals, {"load_LE": out["load_LE"]}, spec)

    def read(self, pending) -> tuple[dict[str, float], bool]:
        return read_step(self.opt, pending)

    def eval_losses(self, batches) -> list[float]:
        losses = []
        with torch.no_grad():
            for batch in batches:
                x = torch.from_numpy(_shard(batch, self.ctx, "eval batch")).to(self.ctx.device, dtype=torch.long)
                _, out = self.loss_fn(self.model, x, self.spec.optim, batch.shape[0] * (batch.shape[1] - 1))
                losses.append(out["global"]["loss"])
        return torch.stack(losses).float().cpu().tolist() if losses else []

    def agree(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.ctx.group)
        return box[0]

    def extra(self) -> dict:
        return {"ep_world_size": self.ctx.size}

    def describe(self) -> dict:
        o, cuda = self.options, self.ctx.device.type == "cuda"
        return {"device": str(self.ctx.device), "torch_fast": False,  # its own sharded loss, on the fp32 masters
                "torch_master": False, "torch_kernels": dataclasses.asdict(kernels_here(o.torch_kernels)) if cuda else None,
                "torch_ep": "processes", "cpu_threads": o.cpu_threads, "torch_dispatch": dispatcher_name(self.model)}

    def finish(self, first_step: int, steps: int) -> None:
        write_summary(self.run_dir, self.model, self.ctx, first_step=first_step, steps=steps)


def train_ep(spec: Spec, run_dir: str | Path, ctx: EPContext, resume: bool = True, stop_after: int | None = None,
             checkpoints: bool = True, options: EngineOptions | None = None) -> Iterator[StepMetrics]:
    """Yields every step's StepMetrics on every rank (the same global values); rank 0 writes them."""
    options = options or EngineOptions()
    check_layout(spec.model, ctx.size, spec.data.batch_size)
    if ctx.device.type == "cpu" and cpu_threads(spec, options):
        torch.set_num_threads(cpu_threads(spec, options))
    module = EPStep(spec, ctx, Path(run_dir), options)
    yield from Trainer(spec, run_dir, module, stop_after=stop_after, checkpoints=checkpoints).fit(resume)


def write_summary(run_dir: Path, model, ctx: EPContext, first_step: int, steps: int) -> None:
    """run_dir/ep.json: what each rank held and did in this launch (rank 0 writes it)."""
    lo, hi = ctx.experts(model.m)
    me = {
        "rank": ctx.rank,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "experts": [lo, hi],
        "expert_params": sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n)),
        "dense_params": sum(p.numel() for n, p in model.named_parameters() if not is_expert_param(n)),
        "expert_rows": {n: int(p.shape[0]) for n, p in model.named_parameters() if is_expert_param(n)},
        "peak_memory_bytes": _peak_memory_bytes(ctx.device),
        "all_to_all_calls": Counters.all_to_all,
        "all_reduce_calls": Counters.all_reduce,
    }
    ranks = [None] * ctx.size
    dist.all_gather_object(ranks, me, group=ctx.group)
    if ctx.rank == 0:
        atomic_write_json(run_dir / SUMMARY_FILE, {
            "world_size": ctx.size, "backend": dist.get_backend(ctx.group), "first_step": first_step, "steps": steps,
            "ranks": ranks})


class StepProfiler:
    """torch.profiler over steps 3 and 4 of this launch (compilation is over by then); the rank's
    operator table, by device time and by host time, goes to PREFIX.rank<r>.txt."""

    FIRST, STEPS = 2, 2

    def __init__(self, prefix: Path, ctx: EPContext):
        self.prefix, self.ctx, self.seen, self.prof, self.t0 = prefix, ctx, 0, None, 0.0

    def after_step(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.seen += 1
        if self.seen == self.FIRST:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.prof is not None and self.seen == self.FIRST + self.STEPS:
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            avg = self.prof.key_averages()
            dev_key = "self_device_time_total" if self.ctx.device.type == "cuda" else "self_cpu_time_total"
            text = (f"rank {self.ctx.rank}: {1e3 * wall / self.STEPS:.1f} ms per step over {self.STEPS} steps\n\n"
                    f"by {dev_key}:\n{avg.table(sort_by=dev_key, row_limit=40)}\n\n"
                    f"by self_cpu_time_total:\n{avg.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
            self.prefix.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{self.prefix}.rank{self.ctx.rank}.txt").write_text(text)
            self.prof = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.torch.ep_train", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", type=Path, help="spec file (.yaml or .json)")
    p.add_argument("--run-dir", type=Path, required=True, help="where metrics, status and checkpoints go")
    p.add_argument("--steps", type=int, default=None, help="stop after this step of the schedule")
    p.add_argument("--no-resume", action="store_true", help="start over, discarding this run dir's checkpoints")
    p.add_argument("--no-checkpoints", action="store_true", help="write no checkpoints (benchmarks)")
    p.add_argument("--options", type=Path, default=None, metavar="FILE",
                   help="engine options as JSON (EngineOptions.to_dict); default: from the environment")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if present")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints a line every this many steps")
    p.add_argument("--profile", type=Path, default=None, metavar="PREFIX",
                   help="torch.profiler over two steps after the first two; each rank writes PREFIX.rank<r>.txt")
    args = p.parse_args(argv)
    spec = read_args(args.spec, args.steps)
    if spec is None:
        return 2
    try:
        options = (EngineOptions.from_dict(json.loads(args.options.read_text())) if args.options
                   else EngineOptions.from_env())
    except (OSError, ValueError, TypeError) as err:
        print(f"error: --options {args.options}: {err}" if args.options else f"error: {err}", file=sys.stderr)
        return 2
    die_with_parent()  # a rank whose torchrun is gone stops too
    try:
        # the layout first: a wrong process count is reported before any rendezvous
        check_layout(spec.model, int(os.environ.get("WORLD_SIZE", "1")), spec.data.batch_size)
        ctx = setup_from_env(args.device)
    except EPError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prof = StepProfiler(args.profile, ctx) if args.profile else None
    records = train_ep(spec, args.run_dir, ctx, resume=not args.no_resume, stop_after=args.steps,
                       checkpoints=not args.no_checkpoints, options=options)
    return drive(spec, args.run_dir, records, lead=ctx.rank == 0, where=f"{ctx.size} rank(s)",
                 errors=(EPError, CheckpointError, DataError), barrier=lambda: dist.barrier(group=ctx.group),
                 log_every=args.log_every, after_step=prof.after_step if prof is not None else None)


if __name__ == "__main__":
    exit_now(main())
