"""Training a spec on a multi-process layout (engines/torch/parallel/layout.py): the one step
module (engines/torch/step.TorchStep) on every rank, with the layout's dense sharding (replicated,
or FSDP2: engines/torch/parallel/fully_shard.py), and under FSDP2 the trainer of sharded
checkpoints (torch.distributed.checkpoint) and their export to the engine-neutral format.

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

import torch
import torch.distributed as dist

from core.spec import Spec
from engines.base import StepMetrics
from engines.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, missing_parent_checkpoint,
                                warn_if_other_data)
from engines.options import EngineOptions
from engines.torch.parallel.checkpoint import SHARDED, export, load_sharded, newest_intact_sharded, read_state, save_sharded
from engines.torch.parallel.layout import Layout
from engines.torch.parallel.replicate import dense_sharding
from engines.torch.step import TorchStep, cpu_threads
from engines.trainer import RunHistoryError, Trainer, check_same_run

ENGINE_NAME = "torch"


class ParallelTrainer(Trainer):
    """engines/trainer.py's Trainer with the mesh's sharded checkpoints: every rank writes its
    shards (run_dir/sharded), and a run resumes from the newest of those (the same ep) and the
    engine-neutral checkpoints (an export, another engine's run: any layout)."""

    module: TorchStep

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
    The dense parameters replicated (engine-neutral checkpoints: engines/torch/parallel/replicate.py)
    or sharded by FSDP2 (sharded checkpoints: ParallelTrainer), as options.torch_dense says
    (replicate.dense_sharding); the step module is TorchStep either way."""
    options = options or EngineOptions()
    threads = cpu_threads(spec, options)
    if layout.device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    dense = dense_sharding(spec, layout, options.torch_dense)
    if dense == "replicate" and resume:
        export_newer_sharded(Path(run_dir), layout)
    step = TorchStep(spec, layout.device, options, layout=layout, run_dir=Path(run_dir), dense=dense)
    kind = Trainer if dense == "replicate" else ParallelTrainer
    trainer = kind(spec, run_dir, step, stop_after=stop_after, checkpoints=checkpoints)
    yield from trainer.fit(resume)
