"""TorchEngine: trains a spec with the PyTorch MoE transformer, appends every StepMetrics to
run_dir/metrics.jsonl, checkpoints in the engine-neutral format and resumes exactly.

Step s (0-based) trains on stream.batch(s) at lr(spec, s); its record has step=s and tokens =
tokens seen after it. Checkpoints are named by updates done (step_00000025 after steps 0..24),
written every run.checkpoint_every updates and at the end, plus step_00000000 with the initial
weights of a fresh run (another engine, or a parity check, can start from it). Eval: the
trainer's fixed eval set (engines/trainer.py), each batch's mean CE from eval_losses.

A NaN or inf loss or grad norm stops the run: the optimizer skips that step's update on the
device, status.json becomes "diverged" and DivergedError is raised; the checkpoints on disk are
the last good ones. Each step's metrics are read after the next step was launched
(engines/lookahead.py), except where an eval, a checkpoint or the end needs the state at once.

Replans: a spec with lineage.resume_step continues its parent's run. Seed the child's run dir
first with engines.checkpoint.init_from_checkpoint(run_dir, <parent run>/checkpoints/step_N,
metrics_from=<parent run>); train() then resumes from that checkpoint (its spec id is the
parent's, which lineage.parent_id allows).

The launcher follows the layout (engines/torch/parallel/launch.py): one device in this process
(engines/torch/step.TorchStep; a spec with model.ep_size > 1 there has its shards emulated), or
model.ep_size processes under torchrun where the machine has that many GPUs
(engines/torch/parallel/). Across hosts, Ray Train starts the ranks (ladder/train_launch.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator

import torch

from core.spec import Spec
from engines.base import StepMetrics
from engines.options import EngineOptions
from engines.torch.parallel.launch import emulation_warning, train_processes, use_processes
from engines.torch.step import TorchStep, cpu_threads, default_device
from engines.trainer import Trainer


class TorchEngine:
    name = "torch"

    def __init__(self, device: str | torch.device | None = None, options: EngineOptions | None = None):
        self.device = torch.device(device) if device is not None else None
        self.options = options

    def train(self, spec: Spec, run_dir: str | Path, resume: bool = True) -> Iterator[StepMetrics]:
        device = self.device or default_device()
        options = self.options or EngineOptions.for_spec(spec)  # built once, when the run starts

        if use_processes(spec, device, options):  # real expert parallel: model.ep_size processes
            yield from train_processes(spec, Path(run_dir), resume, device, options)
            return
        note = emulation_warning(spec, device, options)
        if note:
            warnings.warn(note, stacklevel=2)
        threads_before = torch.get_num_threads()
        if device.type != "cuda" and cpu_threads(spec, options):
            torch.set_num_threads(cpu_threads(spec, options))
        try:
            # step s + 1 is launched before step s is read (engines/lookahead.py); a non-finite
            # step ends the run at its record, and no state after it is ever saved
            yield from Trainer(spec, run_dir, TorchStep(spec, device, options)).fit(resume)
        finally:
            torch.set_num_threads(threads_before)
