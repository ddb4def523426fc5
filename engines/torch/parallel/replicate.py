"""The replicated layout (Olmo-core 3's DDP-style expert parallelism): every rank holds the dense
parameters whole and its own shard of the routed experts whole, resident between steps (nothing is
gathered or freed), so the one-device step runs unchanged on each rank: its optimizer (MasterAdamW
with bf16 working copies at fixed addresses), its compiled blocks replayed as CUDA graphs, its
lookahead. What the layout adds is here: after the backward, the gradients of the dense
parameters are summed over every rank and those of the experts over their data group (each rank's
backward seeded its share of the global objective: engines/torch/model.sharded_objective), and
the gradient norm is the global one. With one rank none of this communicates.

FSDP2 (engines/torch/parallel/fsdp.py) is the other dense sharding, for dense state too large to
hold whole on every rank: `torch_dense` (core/options.py) chooses, and `dense_sharding` says
what "auto" means.

Shape legend: N a tensor's elements, flattened.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.costs import param_counts
from core.spec import Spec
from engines.torch.master import MasterAdamW, foreach_norms
from engines.torch.parallel.layout import Layout
from engines.torch.parallel.model import is_expert_param

# "auto" replicates where the dense state (fp32 masters, moments, bf16 working copies and their
# gradients: about 20 bytes a parameter) and this rank's experts fit in this share of the device
REPLICATE_MAX_SHARE = 0.5
BYTES_A_PARAMETER = 20


def dense_sharding(spec: Spec, layout: Layout, choice: str) -> str:
    """"replicate" or "fsdp" for `choice` ("auto", "replicate", "fsdp"). auto: on a GPU,
    replicate when the rank's whole state fits in REPLICATE_MAX_SHARE of its memory, else fsdp;
    on the CPU fsdp (the layout the CPU tests pin)."""
    if choice != "auto":
        return choice
    if layout.device is None or layout.device.type != "cuda":
        return "fsdp"
    counts = param_counts(spec.model)
    expert = counts["routed_experts"]
    held = (counts["total"] - expert + expert // layout.ep) * BYTES_A_PARAMETER
    memory = torch.cuda.get_device_properties(layout.device).total_memory
    return "replicate" if held <= REPLICATE_MAX_SHARE * memory else "fsdp"


def split_grads(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense, expert) gradients of every tensor the optimizer reads a gradient from, in a fixed
    order (the same on every rank): MasterAdamW's working-copy leaves and its parameters without
    one, else the parameters. A missing gradient is made zeros, so every rank reduces the same
    tensors."""
    named: list[tuple[str, torch.Tensor]] = []
    held: set = set()
    if isinstance(opt, MasterAdamW):
        named += list(opt.working().items())
        held = set(opt.with_working_copy())
    named += [(n, p) for n, p in model.named_parameters() if p not in held]
    dense, expert = [], []
    for name, t in named:
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        (expert if is_expert_param(name) else dense).append(t.grad)
    return dense, expert


def _sum_into(grads: list[torch.Tensor], group) -> None:
    """Sum `grads` over `group` in place: one fp32 all-reduce of them flattened (bf16 gradients
    are summed in fp32 and rounded once)."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat_N = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat_N, op=dist.ReduceOp.SUM, group=group)
    for g, part in zip(grads, flat_N.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def reduce_grads(dense: list[torch.Tensor], expert: list[torch.Tensor], layout: Layout) -> None:
    """The dense gradients summed over every rank, the experts' over their data group."""
    if layout.world > 1:
        _sum_into(dense, layout.flat.get_group())
        _sum_into(expert, layout.data_group)


def _square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack(foreach_norms(grads)).pow(2).sum() if grads else torch.zeros((), device=device)


def global_norm(dense: list[torch.Tensor], expert: list[torch.Tensor], extra: torch.Tensor, layout: Layout
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the global gradient norm of reduced gradients, `extra` summed over every rank) in one
    all-reduce: after reduce_grads the dense gradients are the same on every rank and an expert
    shard's the same on its dp replicas, so the dense squares count 1/world and the experts'
    1/dp from each rank."""
    squares = torch.stack([_square_sum(dense, extra.device) / layout.world,
                           _square_sum(expert, extra.device) / layout.dp])
    flat = torch.cat([squares.float(), extra.float()])
    if layout.world > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=layout.flat.get_group())
    return (flat[0] + flat[1]).sqrt(), flat[2:]
