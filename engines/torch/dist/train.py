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
import shutil
import sys
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from core.fsutil import atomic_write_json
from core.spec import Spec
from engines.base import StepMetrics
from engines.checkpoint import CheckpointError, load_checkpoint, missing_parent_checkpoint, warn_if_other_data
from engines.data import DataError, TokenStream
from engines.torch.dist.checkpoint import (
    SHARDED,
    load_moments,
    load_sharded,
    newest_intact_sharded,
    optimizer_step,
    read_state,
    save_sharded,
)
from engines.torch.dist.fsdp import build_sharded_model, full_arrays, grad_norm_and_clip, held_bytes, load_full, reshard
from engines.torch.dist.mesh import MeshContext, MeshError, check_mesh, setup_mesh
from engines.options import EngineOptions
from engines.torch.engine import cpu_threads, dispatcher_name
from engines.torch.ep_launch import die_with_parent
from engines.trainer import FINITE_KEYS, METRIC_KEYS, VALUE_KEYS, RunHistoryError, Trainer, check_same_run
from engines.torch.ep import step_metrics
from engines.torch.model import init_params
from engines.torch.rank_main import drive, exit_now, read_args

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


class MeshStep:
    """The mesh's step module (engines/trainer.py): this rank's shards and tokens; every rank
    computes the same global values. Each step is read before the next is launched (its
    collectives synchronise the ranks anyway)."""

    engine = ENGINE_NAME
    lookahead = False
    synchronous = True

    def __init__(self, spec: Spec, mc: MeshContext, run_dir: Path):
        self.spec, self.mc, self.run_dir = spec, mc, run_dir
        self.lead = mc.rank == 0
        self.devices = mc.world
        self.model = build_sharded_model(spec.model, mc)
        self.opt = build_optimizer(self.model, spec)

    def init_fresh(self) -> None:
        load_full(self.model, init_params(self.spec.model, self.spec.seed), self.mc)

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        load_full(self.model, params, self.mc)
        load_moments(self.model, self.opt, opt, self.mc)

    def save_arrays(self):
        reshard(self.model)
        params = full_arrays(dict(self.model.named_parameters()) | dict(self.model.named_buffers()), self.mc)
        moments = {}
        for name, p in self.model.named_parameters():
            st = self.opt.state.get(p) or {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            moments[f"m/{name}"], moments[f"v/{name}"] = st["exp_avg"], st["exp_avg_sq"]
        opt = full_arrays(moments, self.mc)
        if not self.lead:
            return None
        opt["step"] = np.asarray(optimizer_step(self.opt), np.int64)
        return params, opt

    def batch_part(self, batch_size: int) -> tuple[int, int]:
        """Each rank reads only its own sequences of a step's batch (engines.data.TokenStream.batch)."""
        check_mesh(self.spec.model, self.mc.world, batch_size)
        return self.mc.part, self.mc.world

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        """batch_BS1: this rank's rows of the step's batch (batch_part), [B / world, S + 1]."""
        spec, model, opt, mc, m = self.spec, self.model, self.opt, self.mc, self.spec.model
        n_tok = batch_BS1.shape[0] * mc.world * (batch_BS1.shape[1] - 1)
        x = torch.from_numpy(batch_BS1).to(mc.device, dtype=torch.long)
        for g in opt.param_groups:
            g["lr"] = lr
        total_r, out = model(x, spec.optim, n_tok)
        total_r.backward()
        grad_norm, sums = grad_norm_and_clip(model, spec.optim.grad_clip,
                                             torch.stack([out["aux_r"], out["total_r"]]), mc)
        metrics = step_metrics(out, sums[0], sums[1])
        vals = dict(zip(VALUE_KEYS, torch.stack([metrics[k].float() for k in METRIC_KEYS]
                                                + [grad_norm.float()]).tolist()))
        finite = all(np.isfinite(vals[k]) for k in FINITE_KEYS)
        if finite:  # a non-finite step is not applied (every rank sees the same global values)
            opt.step()
            if m.router_bias_balancing:
                with torch.no_grad():
                    load_LE = out["load_LE"]
                    upd_LE = m.router_bias_rate * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)
                    for i, blk in enumerate(model.blocks):
                        blk.moe.router_bias.add_(upd_LE[i])
        opt.zero_grad(set_to_none=True)
        return vals, finite

    def read(self, handle) -> tuple[dict[str, float], bool]:
        return handle

    def eval_losses(self, batches) -> list[float]:
        losses = []
        with torch.no_grad():
            for batch in batches:
                x = torch.from_numpy(self.mc.local_batch(batch)).to(self.mc.device, dtype=torch.long)
                _, out = self.model(x, self.spec.optim, batch.shape[0] * (batch.shape[1] - 1))
                losses.append(out["global"]["loss"])
        reshard(self.model)
        return torch.stack(losses).float().cpu().tolist() if losses else []

    def agree(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def extra(self) -> dict:
        return {"mesh": [self.mc.dp, self.mc.ep]}

    def describe(self) -> dict:
        """How this run computes (status.json and the checkpoint info): the reference forward in
        fp32 with the mesh's dispatcher."""
        return {"device": str(self.mc.device), "torch_fast": False, "torch_master": False,
                "torch_dispatch": dispatcher_name(self.model)}

    def finish(self, first_step: int, steps: int) -> None:
        write_summary(self.run_dir, self.model, self.opt, self.mc, first_step=first_step, steps=steps)


class MeshTrainer(Trainer):
    """engines/trainer.py's Trainer with the mesh's sharded checkpoints: every rank writes its
    shards (run_dir/sharded), and a run resumes from the newest of those (the same ep) and the
    engine-neutral checkpoints (an export, another engine's run: any layout)."""

    module: MeshStep

    def save(self, done: int) -> None:
        info = {"tokens": self.tokens, "spec_id": self.spec.id, "spec_name": self.spec.name,
                "engine": ENGINE_NAME, "data": self.stream.state(done), **self.module.extra(),
                "options": self._options()}
        path = save_sharded(self.run.path, done, self.module.model, self.module.opt, info, self.module.mc,
                            keep=self.spec.run.keep_checkpoints)
        self.last_good = (path, "written by this run")

    def _pick(self, resume: bool) -> tuple[tuple[str, str] | None, str]:
        """On the lead: (("sharded" | "neutral", path) or None, why the run is refused or "")."""
        if not resume:
            shutil.rmtree(self.run.path / SHARDED, ignore_errors=True)
        neutral, refused = self._choose(resume)  # the newest intact engine-neutral checkpoint
        sharded = newest_intact_sharded(self.run.path, warn=warnings.warn) if resume else None
        if sharded is not None and read_state(sharded).get("mesh", {}).get("ep") != self.module.mc.ep:
            sharded = None  # another expert split: only its export continues here
        if sharded is not None and (not neutral or int(sharded.name[5:]) >= int(Path(neutral).name[5:])):
            return ("sharded", str(sharded)), ""
        if neutral:
            return ("neutral", neutral), ""
        return None, refused

    def _restore(self, resume: bool) -> Path | None:
        spec, module = self.spec, self.module
        point, refused = module.agree(self._pick(resume) if module.lead else (None, ""))
        if refused:
            raise RunHistoryError(refused)
        if point is None:
            if spec.lineage.resume_step is not None:
                raise missing_parent_checkpoint(spec, self.run.path)
            module.init_fresh()
            self.start, self.tokens = 0, 0
            return None
        kind, path = point[0], Path(point[1])
        if kind == "sharded":
            info = load_sharded(path, module.model, module.opt, module.mc, verify=False)  # the lead verified it
        else:
            params, opt_arrays, info = load_checkpoint(path, verify=False)  # the lead verified it
            try:
                module.load_arrays(params, opt_arrays, str(path))
            except ValueError as err:
                raise CheckpointError(f"{path}: {err}") from err
        check_same_run(spec, info, path)
        self.last_good = (path, f"the {kind} checkpoint this run resumed from")
        self.start = int(info["step"])
        self.tokens = int(info.get("tokens", self.start * spec.data.tokens_per_step))
        if module.lead:
            warn_if_other_data(path, info, self.stream.fingerprint)
        return path


def train_mesh(spec: Spec, run_dir: str | Path, mc: MeshContext, resume: bool = True,
               stop_after: int | None = None) -> Iterator[StepMetrics]:
    """Every rank yields every step's StepMetrics (the same global values); rank 0 writes them."""
    threads = cpu_threads(spec, EngineOptions.from_env())
    if mc.device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    module = MeshStep(spec, mc, Path(run_dir))
    yield from MeshTrainer(spec, run_dir, module, stop_after=stop_after).fit(resume)


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
    spec = read_args(args.spec, args.steps)
    if spec is None:
        return 2
    die_with_parent()
    try:
        mc = setup_mesh(spec.model, spec.data.batch_size, args.device)
    except MeshError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    records = train_mesh(spec, args.run_dir, mc, resume=not args.no_resume, stop_after=args.steps)
    return drive(spec, args.run_dir, records, lead=mc.rank == 0, where=f"{mc.dp} x {mc.ep} (data x expert)",
                 errors=(MeshError, CheckpointError, DataError), barrier=dist.barrier, log_every=args.log_every)


if __name__ == "__main__":
    exit_now(main())  # as ep_train: no gloo teardown in the interpreter's finalisation
