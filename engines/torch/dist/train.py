"""Train a spec on a (data x expert) mesh of processes: FSDP2 shards, pooled-wave experts.

    torchrun --standalone --nproc_per_node N -m engines.torch.dist.train SPEC.yaml --run-dir DIR [--steps S]

N = dp * model.ep_size processes (engines/torch/dist/mesh.py); GPUs with NCCL, else CPU
processes with gloo. The result does not depend on dp: every rank computes the step's global
metrics, and rank 0 writes run_dir/metrics.jsonl (the StepMetrics of the one-device engine),
status.json and mesh.json (the layout and the bytes each rank held). Every rank writes its own
shards of each checkpoint (run_dir/sharded/, engines/torch/dist/checkpoint.py). A run resumes from
the newest of its sharded checkpoints (any dp, the same ep) and the engine-neutral ones in
run_dir/checkpoints (another engine's, or an export: any layout).

Ray Train starts the same function (train_mesh) in its workers (ladder/train_launch.py).
--steps S stops after step S of the schedule with a checkpoint. Exit codes: 0 done, 2 bad input
or layout (one line on stderr), 3 diverged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from pydantic import ValidationError

from core.fsutil import atomic_write_json
from core.spec import Spec, SpecError, format_validation_error, load_spec
from engines.base import DivergedError, MetricsWriter, StepMetrics, write_status
from engines.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, missing_parent_checkpoint
from engines.data import DataError, TokenStream
from engines.torch.dist.checkpoint import latest_sharded, load_moments, load_sharded, read_state, save_sharded
from engines.torch.dist.fsdp import build_sharded_model, grad_norm_and_clip, held_bytes, load_full, reshard
from engines.torch.dist.mesh import MeshContext, MeshError, check_mesh, setup_mesh
from engines.torch.engine import _flops_per_token, cpu_threads
from engines.torch.ep_launch import die_with_parent
from engines.trainer import METRIC_KEYS, LearningRates, check_same_run, record
from engines.torch.ep import step_metrics
from engines.torch.model import init_params

ENGINE_NAME = "torch"
SUMMARY_FILE = "mesh.json"


def build_optimizer(model, spec: Spec) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices and expert stacks only, as the one-device engine."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    o = spec.optim
    if o.moments != "fp32":
        raise MeshError("optim.moments bf16 is not supported on a mesh: the sharded AdamW keeps fp32 moments")
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=o.peak_lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)


def _resume_point(run_dir: Path, mc: MeshContext) -> tuple[str, Path] | None:
    """The newest checkpoint this run can continue from: ("sharded" | "neutral", path)."""
    sharded = latest_sharded(run_dir)
    if sharded is not None and read_state(sharded).get("mesh", {}).get("ep") != mc.ep:
        sharded = None
    neutral = latest_checkpoint(run_dir)
    if sharded is None and neutral is None:
        return None
    if neutral is None or (sharded is not None and int(sharded.name[5:]) >= int(neutral.name[5:])):
        return "sharded", sharded
    return "neutral", neutral


def train_mesh(spec: Spec, run_dir: str | Path, mc: MeshContext, resume: bool = True,
               stop_after: int | None = None) -> Iterator[StepMetrics]:
    """Every rank yields every step's StepMetrics (the same global values); rank 0 writes them."""
    run_dir = Path(run_dir)
    lead = mc.rank == 0
    m = spec.model
    if mc.device.type == "cpu" and cpu_threads(spec):
        torch.set_num_threads(cpu_threads(spec))
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        stream = TokenStream.from_spec(spec)  # rank 0 fills the token cache; the others then read it
    dist.barrier()
    if not lead:
        stream = TokenStream.from_spec(spec)
    found = [_resume_point(run_dir, mc) if lead and resume else None]
    dist.broadcast_object_list(found, src=0)
    point = found[0]

    model = build_sharded_model(m, mc)
    opt = build_optimizer(model, spec)
    if point is None:
        if spec.lineage.resume_step is not None:
            raise missing_parent_checkpoint(spec, run_dir)
        load_full(model, init_params(m, spec.seed), mc)
        start, tokens = 0, 0
    else:
        kind, path = point
        if kind == "sharded":
            info = load_sharded(path, model, opt, mc)
        else:
            params, opt_arrays, info = load_checkpoint(path)
            try:
                load_full(model, params, mc)
            except ValueError as err:
                raise CheckpointError(f"{path}: {err}") from err
            load_moments(model, opt, opt_arrays, mc)
        check_same_run(spec, info, path)
        start = int(info["step"])
        tokens = int(info.get("tokens", start * spec.data.tokens_per_step))

    def save(done: int) -> None:
        info = {"tokens": tokens, "spec_id": spec.id, "spec_name": spec.name, "engine": ENGINE_NAME,
                "data": stream.state(done)}
        save_sharded(run_dir, done, model, opt, info, mc, keep=spec.run.keep_checkpoints)

    def evaluate() -> float:
        losses = []
        with torch.no_grad():
            for i in range(spec.run.eval_batches):
                batch = stream.eval_batch(i)
                x = torch.from_numpy(mc.local_batch(batch)).to(mc.device, dtype=torch.long)
                _, out = model(x, spec.optim, batch.shape[0] * (batch.shape[1] - 1))
                losses.append(out["global"]["loss"])
        reshard(model)
        return float(torch.stack(losses).mean())

    total = spec.total_steps
    end = total if stop_after is None else min(stop_after, total)
    lrs = LearningRates(spec)  # a block of steps at a time: nothing in proportion to the run's length
    if lead:
        write_status(run_dir, "running", step=start, engine=ENGINE_NAME, spec_id=spec.id, mesh=[mc.dp, mc.ep])
    if point is None:
        save(0)
    writer = MetricsWriter(run_dir, start) if lead else None
    try:
        t_prev = time.perf_counter()
        for step in range(start, end):
            check_mesh(m, mc.world, stream.batch_size_at(step))
            n_tok = stream.batch_size_at(step) * stream.seq_len_at(step)
            mine = stream.batch(step, rank=mc.stream_rank, world=mc.world)  # only this rank's rows are read
            x = torch.from_numpy(mine).to(mc.device, dtype=torch.long)
            lr = lrs(step)
            for g in opt.param_groups:
                g["lr"] = lr
            total_r, out = model(x, spec.optim, n_tok)
            total_r.backward()
            grad_norm, sums = grad_norm_and_clip(model, spec.optim.grad_clip,
                                                 torch.stack([out["aux_r"], out["total_r"]]), mc)
            metrics = step_metrics(out, sums[0], sums[1])
            vals = dict(zip(METRIC_KEYS + ("grad_norm",),
                            torch.stack([metrics[k].float() for k in METRIC_KEYS] + [grad_norm.float()]).tolist()))
            finite = all(np.isfinite(vals[k]) for k in ("loss", "total_loss", "grad_norm"))
            if finite:
                opt.step()
                if m.router_bias_balancing:
                    with torch.no_grad():
                        load_LE = out["load_LE"]
                        upd_LE = m.router_bias_rate * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)
                        for i, blk in enumerate(model.blocks):
                            blk.moe.router_bias.add_(upd_LE[i])
            opt.zero_grad(set_to_none=True)
            tokens += n_tok
            tps = n_tok / max(time.perf_counter() - t_prev, 1e-9)
            rec = record(step, tokens, lr, vals, tps,
                              mfu=_flops_per_token(spec, x.shape[1] - 1) * tps / (spec.hardware.peak_flops * mc.world),
                              mesh=[mc.dp, mc.ep])
            if not finite:
                if lead:
                    writer.write(rec)
                    write_status(run_dir, "diverged", step=step, engine=ENGINE_NAME, spec_id=spec.id,
                                 loss=rec.loss, grad_norm=rec.grad_norm, last_checkpoint=str(latest_sharded(run_dir)))
                raise DivergedError(f"loss became {rec.loss} (grad norm {rec.grad_norm}) at step {step}; "
                                    f"the last good checkpoint is {latest_sharded(run_dir)}")
            done = step + 1
            if done % spec.run.eval_every == 0 or done == total:
                rec.eval_loss = evaluate()
            if lead:
                writer.write(rec)
            if done % spec.run.checkpoint_every == 0 or done == end:
                save(done)
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
    write_summary(run_dir, model, opt, mc, first_step=start, steps=end - start)
    if lead:
        if end == total:
            write_status(run_dir, "finished", step=total, engine=ENGINE_NAME, spec_id=spec.id, tokens=tokens,
                         mesh=[mc.dp, mc.ep])
        else:
            write_status(run_dir, "running", step=end, engine=ENGINE_NAME, spec_id=spec.id, stopped_at=end,
                         last_checkpoint=str(latest_sharded(run_dir)), mesh=[mc.dp, mc.ep])


def write_summary(run_dir: Path, model, opt, mc: MeshContext, first_step: int, steps: int) -> None:
    """run_dir/mesh.json: each rank's place, experts and the bytes it held (rank 0 writes it)."""
    lo, hi = mc.experts(model.m)
    me = {"rank": mc.rank, "data": mc.d, "expert": mc.e, "experts": [lo, hi],
          **{f"{k}_bytes": v for k, v in held_bytes(model, opt).items()}}
    ranks = [None] * mc.world
    dist.all_gather_object(ranks, me)
    if mc.rank == 0:
        atomic_write_json(run_dir / SUMMARY_FILE, {
            "world_size": mc.world, "dp": mc.dp, "ep": mc.ep, "backend": dist.get_backend(),
            "first_step": first_step, "steps": steps, "ranks": ranks})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.torch.dist.train", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", type=Path, help="spec file (.yaml or .json)")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=None, help="stop after this step of the schedule")
    p.add_argument("--no-resume", action="store_true", help="start over (the checkpoints stay until overwritten)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if present")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
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
    die_with_parent()
    try:
        mc = setup_mesh(spec.model, spec.data.batch_size, args.device)
    except MeshError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    code = 0
    try:
        last = None
        for rec in train_mesh(spec, args.run_dir, mc, resume=not args.no_resume, stop_after=args.steps):
            last = rec
            if mc.rank == 0 and rec.step % args.log_every == 0:
                print(f"step {rec.step}/{spec.total_steps} loss {rec.loss:.4f} drops {rec.drop_frac_send:.4f}/"
                      f"{rec.drop_frac_recv:.4f} {rec.tokens_per_s:,.0f} tok/s", flush=True)
        if mc.rank == 0:
            where = f"{mc.dp} x {mc.ep} (data x expert)"
            print(f"{spec.name}: nothing to do ({args.run_dir})" if last is None else
                  f"{spec.name}: step {last.step + 1}/{spec.total_steps} on {where}, loss {last.loss:.4f}"
                  f" -> {args.run_dir}", flush=True)
        dist.barrier()
    except (MeshError, CheckpointError, DataError) as err:
        if mc.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        code = 2
    except DivergedError as err:
        if mc.rank == 0:
            print(f"diverged: {err}", file=sys.stderr)
        code = 3
    finally:
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as ep_train: no gloo teardown in the interpreter's finalisation
