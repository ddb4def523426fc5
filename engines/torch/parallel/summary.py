"""run_dir/mesh.json: a layout run's ranks, the experts and the bytes each held, and the
collectives each made in a launch (rank 0 writes it, whatever the layout's dense sharding)."""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.distributed as dist

from core.fsutil import atomic_write_json
from engines.torch.parallel.dispatch import Counters
from engines.torch.parallel.fsdp import held_bytes, local_tensor
from engines.torch.parallel.layout import Layout
from engines.torch.parallel.model import is_expert_param

SUMMARY_FILE = "mesh.json"


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def write_summary(run_dir: Path, model, opt, layout: Layout, first_step: int, steps: int) -> None:
    """run_dir/mesh.json: each rank's place, experts, the bytes it held and the collectives it
    made in this launch (rank 0 writes it)."""
    lo, hi = layout.experts(model.m)
    me = {"rank": layout.rank, "data": layout.d, "expert": layout.e, "experts": [lo, hi],
          "device": torch.cuda.get_device_name(layout.device) if layout.device.type == "cuda" else "cpu",
          "expert_rows": {n: int(p.shape[0]) for n, p in model.named_parameters() if is_expert_param(n)},
          "expert_params": sum(local_tensor(p).numel() for n, p in model.named_parameters() if is_expert_param(n)),
          "dense_params": sum(local_tensor(p).numel() for n, p in model.named_parameters() if not is_expert_param(n)),
          **{f"{k}_bytes": v for k, v in held_bytes(model, opt).items()},
          "peak_memory_bytes": _peak_memory_bytes(layout.device),
          "all_to_all_calls": Counters.all_to_all, "all_reduce_calls": Counters.all_reduce}
    ranks = [None] * layout.world
    dist.all_gather_object(ranks, me)
    if layout.rank == 0:
        atomic_write_json(run_dir / SUMMARY_FILE, {
            "world_size": layout.world, "dp": layout.dp, "ep": layout.ep, "backend": dist.get_backend(),
            "first_step": first_step, "steps": steps, "ranks": ranks})
