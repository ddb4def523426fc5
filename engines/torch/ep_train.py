"""Train a spec with expert parallel over model.ep_size processes (one per device).

    torchrun --standalone --nproc_per_node EP -m engines.torch.ep_train SPEC.yaml --run-dir DIR [--steps N]

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
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from engines.base import DivergedError, MetricsWriter, StepMetrics, write_status
from engines.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, remove_checkpoints, save_checkpoint
from engines.data import DataError, TokenStream
from engines.torch.engine import (
    METRIC_KEYS,
    _check_same_run,
    _flops_per_token,
    build_optimizer,
    cpu_threads,
    finish_step,
    step_record,
    optimizer_from_numpy,
    optimizer_to_numpy,
)
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
from engines.torch.model import init_params
from core.fsutil import atomic_write_json
from core.schedule import lr_at
from core.spec import Spec

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


def train_ep(spec: Spec, run_dir: str | Path, ctx: EPContext, resume: bool = True, stop_after: int | None = None,
             checkpoints: bool = True) -> Iterator[StepMetrics]:
    """Yields every step's StepMetrics on every rank (the same global values); rank 0 writes them."""
    run_dir = Path(run_dir)
    lead = ctx.rank == 0
    m = spec.model
    check_layout(m, ctx.size, spec.data.batch_size)
    if ctx.device.type == "cpu" and cpu_threads(spec):
        torch.set_num_threads(cpu_threads(spec))
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        stream = TokenStream.from_spec(spec)  # rank 0 fills the token cache; the others then read it
        if not resume and checkpoints:
            remove_checkpoints(run_dir)
    dist.barrier(group=ctx.group)
    if not lead:
        stream = TokenStream.from_spec(spec)
    found = [str(latest_checkpoint(run_dir) or "") if lead and resume else ""]
    dist.broadcast_object_list(found, src=0, group=ctx.group)
    ckpt = Path(found[0]) if found[0] else None

    model = build_local_model(m, ctx)
    opt = build_optimizer(model, spec, working=False)  # its own sharded loss reads the fp32 masters
    if ckpt is not None:
        params, opt_arrays, info = load_checkpoint(ckpt)
        _check_same_run(spec, info, ckpt)
        try:
            load_local(model, params, ctx)
        except ValueError as err:
            raise CheckpointError(f"{ckpt}: {err}") from err
        optimizer_from_numpy(model, opt, local_slice(opt_arrays, m, ctx))
        start = int(info["step"])
        tokens = int(info.get("tokens", start * spec.data.tokens_per_step))
        seen = (info.get("data") or {}).get("fingerprint")
        if lead and seen and seen != stream.fingerprint:
            warnings.warn(f"{ckpt} was trained on different data: the resumed run is not a replay", stacklevel=2)
    else:
        load_local(model, init_params(m, spec.seed), ctx)
        start, tokens = 0, 0
    loss_fn = EPLoss(model, ctx)

    def save(done: int) -> None:
        full_params = gather_experts(model.to_numpy(), ctx)
        full_opt = gather_experts(optimizer_to_numpy(model, opt), ctx)
        if lead:
            info = {"tokens": tokens, "spec_id": spec.id, "spec_name": spec.name, "engine": ENGINE_NAME,
                    "data": stream.state(done), "ep_world_size": ctx.size}
            save_checkpoint(run_dir, done, full_params, full_opt, info, keep=spec.run.keep_checkpoints)

    def evaluate() -> float:
        losses = []
        with torch.no_grad():
            for i in range(spec.run.eval_batches):
                batch = stream.eval_batch(i)
                x = torch.from_numpy(_shard(batch, ctx, "eval batch")).to(ctx.device, dtype=torch.long)
                _, out = loss_fn(model, x, spec.optim, batch.shape[0] * (batch.shape[1] - 1))
                losses.append(out["global"]["loss"])
        return float(torch.stack(losses).mean())

    total = spec.total_steps
    end = total if stop_after is None else min(stop_after, total)
    lrs = lr_at(spec, np.arange(total))
    n_dev = ctx.size
    if lead:
        write_status(run_dir, "running", step=start, engine=ENGINE_NAME, spec_id=spec.id, ep_world_size=n_dev)
    if ckpt is None and checkpoints:
        save(0)
    writer = MetricsWriter(run_dir, start) if lead else None
    saved_at = start
    try:
        t_prev = time.perf_counter()
        for step in range(start, end):
            batch = stream.batch(step)
            n_tok = batch.shape[0] * (batch.shape[1] - 1)
            x = torch.from_numpy(_shard(batch, ctx, f"batch of step {step}")).to(ctx.device, dtype=torch.long)
            lr = float(lrs[step])
            for g in opt.param_groups:
                g["lr"] = lr
            total_r, out = loss_fn(model, x, spec.optim, n_tok)
            total_r.backward()
            grad_norm, sums = reduce_and_clip(model, ctx, spec.optim.grad_clip,
                                              torch.stack([out["aux_r"], out["total_r"]]).float())
            metrics = step_metrics(out, sums[0], sums[1])
            vals = torch.stack([metrics[k].float() for k in METRIC_KEYS] + [grad_norm.float()])
            mv, finite = finish_step(model, opt, vals, {"load_LE": out["load_LE"]}, spec)
            tokens += n_tok
            dt = max(time.perf_counter() - t_prev, 1e-9)
            tps = n_tok / dt
            rec = step_record(step, tokens, lr, mv, tps,
                              mfu=_flops_per_token(spec, x.shape[1] - 1) * tps / (spec.hardware.peak_flops * n_dev),
                              ep_world_size=n_dev)
            if not finite:
                if lead:
                    writer.write(rec)
                    write_status(run_dir, "diverged", step=step, engine=ENGINE_NAME, spec_id=spec.id,
                                 loss=rec.loss, grad_norm=rec.grad_norm,
                                 last_checkpoint=str(latest_checkpoint(run_dir)))
                raise DivergedError(f"loss became {rec.loss} (grad norm {rec.grad_norm}) at step {step}; "
                                    f"the last good checkpoint is {latest_checkpoint(run_dir)}")
            done = step + 1
            if done % spec.run.eval_every == 0 or done == total:
                rec.eval_loss = evaluate()
            if lead:
                writer.write(rec)
            if checkpoints and (done % spec.run.checkpoint_every == 0 or done == end):
                save(done)
                saved_at = done
            t_prev = time.perf_counter()
            yield rec
    except DivergedError:
        raise
    except BaseException as err:
        if lead and not isinstance(err, GeneratorExit):
            write_status(run_dir, "failed", engine=ENGINE_NAME, spec_id=spec.id, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        if writer is not None:
            writer.close()
    write_summary(run_dir, model, ctx, first_step=start, steps=end - start)
    if lead:
        if end == total:
            write_status(run_dir, "finished", step=total, engine=ENGINE_NAME, spec_id=spec.id, tokens=tokens,
                         ep_world_size=n_dev)
        else:
            write_status(run_dir, "running", step=end, engine=ENGINE_NAME, spec_id=spec.id, stopped_at=end,
                         last_checkpoint=str(latest_checkpoint(run_dir)) if saved_at == end else None,
                         ep_world_size=n_dev)


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
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if present")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints a line every this many steps")
    p.add_argument("--profile", type=Path, default=None, metavar="PREFIX",
                   help="torch.profiler over two steps after the first two; each rank writes PREFIX.rank<r>.txt")
    args = p.parse_args(argv)

    from pydantic import ValidationError

    from core.spec import SpecError, format_validation_error, load_spec

    try:
        spec = load_spec(args.spec)
    except ValidationError as err:
        print(f"error: invalid spec: {format_validation_error(err)}", file=sys.stderr)
        return 2
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps must be >= 1 (got {args.steps})", file=sys.stderr)
        return 2
    from engines.torch.ep_launch import die_with_parent

    die_with_parent()  # a rank whose torchrun is gone stops too
    try:
        # the layout first: a wrong process count is reported before any rendezvous
        check_layout(spec.model, int(os.environ.get("WORLD_SIZE", "1")), spec.data.batch_size)
        ctx = setup_from_env(args.device)
    except EPError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    code = 0
    prof = StepProfiler(args.profile, ctx) if args.profile else None
    try:
        last = None
        for rec in train_ep(spec, args.run_dir, ctx, resume=not args.no_resume, stop_after=args.steps,
                            checkpoints=not args.no_checkpoints):
            last = rec
            if prof is not None:
                prof.after_step()
            if ctx.rank == 0 and (rec.step % args.log_every == 0):
                print(f"step {rec.step}/{spec.total_steps} loss {rec.loss:.4f} drops {rec.drop_frac_send:.4f}/"
                      f"{rec.drop_frac_recv:.4f} {rec.tokens_per_s:,.0f} tok/s", flush=True)
        if ctx.rank == 0:
            if last is None:
                print(f"{spec.name}: nothing to do ({args.run_dir})", flush=True)
            else:
                print(f"{spec.name}: step {last.step + 1}/{spec.total_steps} on {ctx.size} rank(s), loss {last.loss:.4f}"
                      f" -> {args.run_dir}", flush=True)
        # every rank reaches the teardown together: a gloo rank whose peer has already closed its
        # connections can abort in its transport thread ("terminate called without an active exception")
        dist.barrier(group=ctx.group)
    except (EPError, CheckpointError, DataError) as err:
        if ctx.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        code = 2
    except DivergedError as err:
        if ctx.rank == 0:
            print(f"diverged: {err}", file=sys.stderr)
        code = 3
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's finalisation: after a complete run (metrics, status and
    # checkpoints written atomically, the process group destroyed) a gloo rank could still abort
    # there ("terminate called without an active exception", exit -6), its transport's worker
    # threads torn down with the interpreter, which failed the whole launch.
    os._exit(code)
