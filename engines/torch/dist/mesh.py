"""The (data, expert) device mesh of a distributed torch run.

world = dp * ep processes, ep = model.ep_size (from the spec: it is part of what the run
computes), dp = world / ep (from the launch: it is not). Rank r sits at (d, e) = divmod(r, ep):
- its expert group is row d, the ep ranks (d, 0..ep-1): the pooled-wave all-to-all runs there,
  and rank (d, e) holds routed experts [e * E/ep, (e+1) * E/ep);
- its data group is column e, the dp ranks (0..dp-1, e): the replicas of expert shard e, over
  which FSDP2 shards those experts;
- the dense parameters are sharded by FSDP2 over all dp * ep ranks (every rank sees other tokens).

Tokens. The step's batch is split into ep contiguous source shards of whole sequences (the
shards the one-device engine emulates), and source shard e into dp contiguous parts: rank (d, e)
holds part d of shard e. The transport ranks a source shard's assignments over its dp parts
(engines/torch/dist/moe.py), so drops, losses and gradients do not depend on dp: the same spec
is the same run on any mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engines.torch.ep import NO_MULTICAST, EPContext, EPError, join_process_group, local_device
from core.spec import ModelSpec


class MeshError(EPError):
    """A run that cannot be laid out on the mesh; the message says what and how to fix it."""


@dataclass
class MeshContext:
    rank: int
    world: int
    dp: int
    ep: int
    device: torch.device
    mesh: DeviceMesh  # ("data", "expert")
    flat: DeviceMesh  # all ranks, one dimension: the dense parameters' FSDP mesh

    @property
    def d(self) -> int:
        return self.rank // self.ep

    @property
    def e(self) -> int:
        return self.rank % self.ep

    @property
    def expert_group(self):
        return self.mesh.get_group("expert")

    @property
    def data_group(self):
        return self.mesh.get_group("data")

    def ep_context(self) -> EPContext:
        """The expert group as engines.torch.ep sees it (its all-to-all helpers take one)."""
        return EPContext(rank=self.e, size=self.ep, device=self.device, group=self.expert_group)

    def experts(self, m: ModelSpec) -> tuple[int, int]:
        n = m.n_routed_experts // self.ep
        return self.e * n, (self.e + 1) * n

    @property
    def part(self) -> int:
        """This rank's sequences are the part-th of world contiguous, equal parts of a step batch:
        part d of source shard e (with batch_size % world == 0, e * B/ep + d * B/world)."""
        return self.e * self.dp + self.d

    def rows(self, batch_size: int) -> slice:
        """This rank's sequences of a [batch_size, ...] step batch: part d of source shard e."""
        per_rank = batch_size // self.world
        return slice(self.part * per_rank, (self.part + 1) * per_rank)

    def local_batch(self, batch_BS1: np.ndarray) -> np.ndarray:
        return batch_BS1[self.rows(batch_BS1.shape[0])]


def check_mesh(m: ModelSpec, world: int, batch_size: int) -> int:
    """dp for `world` processes, or MeshError naming what does not fit."""
    ep = m.ep_size
    if world % ep:
        raise MeshError(f"{world} process(es) do not form a (data x expert) mesh with model.ep_size {ep}: "
                        f"start a multiple of {ep}")
    dp = world // ep
    if batch_size % world:
        raise MeshError(f"data.batch_size ({batch_size}) must be a multiple of the {world} processes "
                        f"(data {dp} x expert {ep}): each rank holds whole sequences")
    if m.n_routed_experts % ep:
        raise MeshError(f"model.n_routed_experts ({m.n_routed_experts}) must be a multiple of model.ep_size ({ep})")
    return dp


def setup_mesh(m: ModelSpec, batch_size: int, device: str | None = None) -> MeshContext:
    """Join the process group the launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT:
    torchrun or Ray Train), gloo on the CPU, NCCL on GPUs, and build the mesh."""
    for var, off in NO_MULTICAST.items():
        os.environ.setdefault(var, off)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_mesh(m, world, batch_size)  # before any rendezvous
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = local_device(device, local, MeshError)
    join_process_group(dev, int(os.environ.get("RANK", "0")), world)
    mesh = init_device_mesh(dev.type, (dp, m.ep_size), mesh_dim_names=("data", "expert"))
    return MeshContext(rank=dist.get_rank(), world=world, dp=dp, ep=m.ep_size, device=dev, mesh=mesh,
                       flat=mesh._flatten("data_expert"))
