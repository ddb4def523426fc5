"""The torch engine's step module on every multi-process layout (engines/torch/parallel/layout.py):
this rank's shards and tokens, FSDP2 for the parameters (the experts over the data group, the
rest over all ranks), the layout's dispatcher for the experts, the one forward for everything
(engines/torch/parallel/model.py), sharded checkpoints (torch.distributed.checkpoint) and their
export to the engine-neutral format.

The result does not depend on the layout: every rank computes the step's global metrics, and rank
0 writes run_dir/metrics.jsonl (the StepMetrics of the one-device engine), status.json and
mesh.json (the layout, the experts and the bytes each rank held, the collectives it made). Every
rank writes its own shards of each checkpoint (run_dir/sharded/, engines/torch/parallel/
checkpoint.py). A run resumes from the newest of its sharded checkpoints (any dp, the same ep)
and the engine-neutral ones in run_dir/checkpoints (another engine's, or an export: any layout).

torchrun starts it through engines/torch/parallel/train.py, Ray Train through train_layout in its
workers (ladder/train_launch.py), TorchEngine.train through engines/torch/parallel/launch.py.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from core.spec import Spec
from engines.base import StepMetrics
from engines.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, missing_parent_checkpoint,
                                warn_if_other_data)
from engines.data import TokenStream
from engines.options import EngineOptions
from engines.torch.experts import kernels_here
from engines.torch.master import build_optimizer
from engines.torch.model import init_params, move_router_bias
from engines.torch.parallel.checkpoint import (
    SHARDED,
    export,
    load_moments,
    load_sharded,
    newest_intact_sharded,
    optimizer_step,
    read_state,
    save_sharded,
)
from engines.torch.parallel.fsdp import (
    build_sharded_model,
    full_arrays,
    gathers_bf16,
    grad_norm_and_clip,
    load_full,
    reshard,
)
from engines.torch.parallel.layout import Layout, LayoutError, check_layout
from engines.torch.parallel.model import ShardedLoss, layout_eval_losses, step_metrics
from engines.torch.parallel.summary import write_summary
from engines.torch.parallel.replicate import dense_sharding
from engines.torch.step import TorchStep, cpu_threads, describe_options, dispatcher_name
from engines.trainer import FINITE_KEYS, METRIC_KEYS, VALUE_KEYS, RunHistoryError, Trainer, check_same_run

ENGINE_NAME = "torch"


class ParallelStep:
    """The step module (engines/trainer.py) of a rank of the layout: its shards and its tokens;
    every rank computes the same global values. Each step is read before the next is launched
    (its collectives synchronise the ranks anyway)."""

    engine = ENGINE_NAME
    lookahead = False
    synchronous = True

    def __init__(self, spec: Spec, layout: Layout, run_dir: Path, options: EngineOptions | None = None):
        self.spec, self.layout, self.run_dir = spec, layout, run_dir
        self.options = options or EngineOptions()
        self.lead = layout.rank == 0
        self.devices = layout.world
        if spec.optim.moments != "fp32":  # (MasterAdamW alone keeps bf16 moments: no layout has it)
            raise LayoutError("optim.moments bf16 is not supported over processes: the sharded AdamW keeps fp32 moments")
        self.model = build_sharded_model(spec.model, layout)
        self.loss = ShardedLoss(self.model, layout, kernels_here(self.options.torch_kernels), hooked=True)
        self.opt = build_optimizer(self.model, spec.optim, sharded=layout.device)

    def init_fresh(self) -> None:
        load_full(self.model, init_params(self.spec.model, self.spec.seed), self.layout)

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        load_full(self.model, params, self.layout)
        load_moments(self.model, self.opt, opt, self.layout)

    def save_arrays(self):
        reshard(self.model)
        params = full_arrays(dict(self.model.named_parameters()) | dict(self.model.named_buffers()), self.layout)
        moments = {}
        for name, p in self.model.named_parameters():
            st = self.opt.state.get(p) or {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            moments[f"m/{name}"], moments[f"v/{name}"] = st["exp_avg"], st["exp_avg_sq"]
        opt = full_arrays(moments, self.layout)
        if not self.lead:
            return None
        opt["step"] = np.asarray(optimizer_step(self.opt), np.int64)
        return params, opt

    def batch_part(self, batch_size: int) -> tuple[int, int]:
        """Each rank reads only its own sequences of a step's batch (engines.data.TokenStream.batch)."""
        check_layout(self.spec.model, self.layout.world, batch_size)
        return self.layout.part, self.layout.world

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        """batch_BS1: this rank's rows of the step's batch (batch_part), [B / world, S + 1]."""
        spec, model, opt, lay, m = self.spec, self.model, self.opt, self.layout, self.spec.model
        n_tok = batch_BS1.shape[0] * lay.world * (batch_BS1.shape[1] - 1)
        x = torch.from_numpy(batch_BS1).to(lay.device, dtype=torch.long)
        for g in opt.param_groups:
            g["lr"] = lr
        total_r, out = model(x, spec.optim, n_tok, run=self.loss)
        total_r.backward()
        grad_norm, sums = grad_norm_and_clip(model, spec.optim.grad_clip,
                                             torch.stack([out["aux_r"], out["total_r"]]), lay)
        metrics = step_metrics(out, sums[0], sums[1])
        vals = dict(zip(VALUE_KEYS, torch.stack([metrics[k].float() for k in METRIC_KEYS]
                                                + [grad_norm.float()]).tolist()))
        finite = all(np.isfinite(vals[k]) for k in FINITE_KEYS)
        if finite:  # a non-finite step is not applied (every rank sees the same global values)
            opt.step()
            if m.router_bias_balancing:
                move_router_bias(model, out["load_LE"], m.router_bias_rate)
        opt.zero_grad(set_to_none=True)
        return vals, finite

    def read(self, handle) -> tuple[dict[str, float], bool]:
        return handle

    def eval_losses(self, batches) -> list[float]:
        losses = layout_eval_losses(lambda x, n: self.model(x, self.spec.optim, n, run=self.loss), batches, self.layout)
        reshard(self.model)
        return losses

    def agree(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def extra(self) -> dict:
        return {"mesh": [self.layout.dp, self.layout.ep]}

    def describe(self) -> dict:
        """How this run computes (status.json and the checkpoint info): the kernels, fp32
        masters (no working copies: on a GPU FSDP2 gathers the blocks' parameters in bf16), the
        layout's dispatcher."""
        return {**describe_options(self.options, self.layout.device, master=False),
                "torch_dispatch": dispatcher_name(self.model),
                "torch_gather_dtype": "bf16" if gathers_bf16(self.layout.device) else "fp32"}

    def finish(self, first_step: int, steps: int) -> None:
        write_summary(self.run_dir, self.model, self.opt, self.layout, first_step=first_step, steps=steps)


class ParallelTrainer(Trainer):
    """engines/trainer.py's Trainer with the mesh's sharded checkpoints: every rank writes its
    shards (run_dir/sharded), and a run resumes from the newest of those (the same ep) and the
    engine-neutral checkpoints (an export, another engine's run: any layout)."""

    module: ParallelStep

    def save(self, done: int) -> None:
        info = {"tokens": self.tokens, "spec_id": self.spec.id, "spec_name": self.spec.name,
                "engine": ENGINE_NAME, "data": self.stream.state(done), **self.module.extra(),
                "options": self._options()}
        path = save_sharded(self.run.path, done, self.module.model, self.module.opt, info, self.module.layout,
                            keep=self.spec.run.keep_checkpoints)
        self.last_good = (path, "written by this run")

    def _pick(self, resume: bool) -> tuple[tuple[str, str] | None, str]:
        """On the lead: (("sharded" | "neutral", path) or None, why the run is refused or "")."""
        if not resume:
            shutil.rmtree(self.run.path / SHARDED, ignore_errors=True)
        neutral, refused = self._choose(resume)  # the newest intact engine-neutral checkpoint
        sharded = newest_intact_sharded(self.run.path, warn=warnings.warn) if resume else None
        if sharded is not None and read_state(sharded).get("mesh", {}).get("ep") != self.module.layout.ep:
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
            info = load_sharded(path, module.model, module.opt, module.layout, verify=False)  # the lead verified it
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


def export_newer_sharded(run_dir: Path, layout: Layout) -> None:
    """A replicated run resumes from engine-neutral checkpoints: where an FSDP2 launch of it left a
    sharded checkpoint newer than its newest engine-neutral one, the lead exports that first."""
    if layout.rank == 0:
        sharded = newest_intact_sharded(run_dir, warn=warnings.warn)
        neutral = latest_checkpoint(run_dir)
        if sharded is not None and (neutral is None or int(sharded.name[5:]) > int(neutral.name[5:])):
            export(run_dir, int(sharded.name[5:]))
    if layout.world > 1:
        dist.barrier()


def train_layout(spec: Spec, run_dir: str | Path, layout: Layout, resume: bool = True, stop_after: int | None = None,
                 checkpoints: bool = True, options: EngineOptions | None = None) -> Iterator[StepMetrics]:
    """Every rank yields every step's StepMetrics (the same global values); rank 0 writes them.
    The dense parameters replicated (the one-device step on each rank, engine-neutral checkpoints:
    engines/torch/parallel/replicate.py) or sharded by FSDP2 (ParallelStep, sharded checkpoints), as
    options.torch_dense says (replicate.dense_sharding)."""
    options = options or EngineOptions()
    threads = cpu_threads(spec, options)
    if layout.device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    if dense_sharding(spec, layout, options.torch_dense) == "replicate":
        if resume:
            export_newer_sharded(Path(run_dir), layout)
        step = TorchStep(spec, layout.device, options, layout=layout, run_dir=Path(run_dir))
        trainer = Trainer(spec, run_dir, step, stop_after=stop_after, checkpoints=checkpoints)
    else:
        module = ParallelStep(spec, layout, Path(run_dir), options)
        trainer = ParallelTrainer(spec, run_dir, module, stop_after=stop_after, checkpoints=checkpoints)
    yield from trainer.fit(resume)
