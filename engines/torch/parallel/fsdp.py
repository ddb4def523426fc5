"""FSDP2 over the (data, expert) mesh: which parameters are sharded where, loading full
(engine-neutral) arrays into the shards, gathering them back, the global gradient norm, and the
bytes each rank really holds.

- each block's routed experts (this rank's expert shard): fully_shard over the data group (with
  ep 1, where that group is every rank, they are part of their block's unit);
- each block's other parameters, the embedding, final norm and head: fully_shard over all ranks;
- gradients are summed (never averaged) by both: each rank's backward seeds its share of the
  global objective (engines/torch/parallel/model.py);
- on a GPU the blocks' and experts' parameters are gathered in bf16 (FSDP2's mixed precision: the
  shards, gradients' reduction and optimizer stay fp32), so the forward's matmuls read them without
  a cast each step, as the one-device path's bf16 working copies; the embedding, final norm and
  head stay fp32 (the residual stream starts fp32). The norms' weights and the router are then
  read in bf16 too, as FSDP2 trainers (torchtitan) do; the one-device path keeps those fp32.
The router's balancing bias is a buffer: every rank holds all of it and updates it alike.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from core.spec import ModelSpec
from engines.torch.parallel.layout import Layout
from engines.torch.model import MoETransformer
from engines.torch.parallel.model import gather_experts, is_expert_param, layout_model


def _summing(module) -> None:
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def _placement(n: int):
    """Shard a tensor along its first dimension that splits over n ranks (else its largest): a
    [1, D, R] shared-expert stack split along dim 0 would sit whole on one rank."""

    def place(p: torch.nn.Parameter) -> Shard:
        fits = [i for i, s in enumerate(p.shape) if s >= n]
        return Shard(fits[0] if fits else int(np.argmax(p.shape)))

    return place


def gathers_bf16(device: torch.device) -> bool:
    """Whether FSDP2 gathers the blocks' and experts' parameters in bf16 (on a GPU)."""
    return device.type == "cuda"


def build_sharded_model(m: ModelSpec, mc: Layout) -> MoETransformer:
    """The rank's model (parallel/model.layout_model), sharded, allocated on its device,
    uninitialised (load_full next)."""
    with torch.device("meta"):
        model = layout_model(m, mc)
    mp = {}
    if gathers_bf16(mc.device):  # inputs (the fp32 residual) are not cast
        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                cast_forward_inputs=False)}
    for blk in model.blocks:
        if mc.ep > 1:  # with ep 1 the data group is every rank: the experts join their block's unit
            fully_shard(blk.moe.experts, mesh=mc.mesh["data"], shard_placement_fn=_placement(mc.dp), **mp)
            _summing(blk.moe.experts)
        fully_shard(blk, mesh=mc.flat, shard_placement_fn=_placement(mc.world), **mp)
        _summing(blk)
    fully_shard(model, mesh=mc.flat, shard_placement_fn=_placement(mc.world))
    _summing(model)
    model.to_empty(device=mc.device)
    return model


def reshard(model: MoETransformer) -> None:
    """Every FSDP2 module back to its shards: the root keeps its parameters gathered after a
    forward without a backward (an eval), and model.parameters() would then name the gathered
    copies, not the sharded parameters the optimizer holds."""
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


def expert_slice(arrays: dict[str, np.ndarray], m: ModelSpec, mc: Layout) -> dict[str, np.ndarray]:
    lo, hi = mc.experts(m)
    return {k: (a[lo:hi] if is_expert_param(k) and np.ndim(a) >= 1 else a) for k, a in arrays.items()}


def _local_of(t: torch.Tensor, full: np.ndarray) -> torch.Tensor:
    """This rank's part of `full` in the layout of t (a sharded DTensor or a plain tensor)."""
    src = torch.from_numpy(np.ascontiguousarray(full, dtype=np.float32))
    if isinstance(t, DTensor):  # a local slice, no communication
        return distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None).to_local()
    return src


def load_full(model: MoETransformer, arrays: dict[str, np.ndarray], mc: Layout) -> None:
    """Copy engine-neutral arrays (all experts) into the shards this rank holds; shapes checked."""
    arrays = expert_slice(arrays, model.m, mc)
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = sorted(set(own) - set(arrays))
    if missing:
        raise ValueError(f"weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for k, t in own.items():
            if tuple(arrays[k].shape) != tuple(t.shape):
                raise ValueError(f"{k} has shape {tuple(arrays[k].shape)}, the spec needs {tuple(t.shape)}")
            local = t.to_local() if isinstance(t, DTensor) else t
            local.copy_(_local_of(t, arrays[k]).to(local.device))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_arrays(named: dict[str, torch.Tensor], mc: Layout) -> dict[str, np.ndarray] | None:
    """Engine-neutral arrays on rank 0 (None elsewhere): every shard gathered, experts over the
    expert group too. Every rank calls it with the same names in the same order."""
    mine = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().numpy()
            for k, t in sorted(named.items())}
    if mc.d != 0:  # row 0 holds every expert shard in full: the other rows only took part in full_tensor
        return None
    return gather_experts(mine, mc)


def grad_norm_and_clip(model: MoETransformer, max_norm: float, extra: torch.Tensor, mc: Layout
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global gradient norm before clipping (every rank's shards are disjoint: one all-reduce
    of the local squares, which also sums `extra`), then every gradient scaled by
    min(1, max_norm / (norm + 1e-6)) as clip_grad_norm_ does. Returns (norm, extra summed)."""
    grads = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(local_tensor(p.grad))
    sq = torch.stack(torch._foreach_norm([g.float() for g in grads], 2)).pow(2).sum()  # one launch a dtype
    flat = torch.cat([sq.view(1), extra.float()])
    dist.all_reduce(flat)
    norm = flat[0].sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm, flat[1:]


def held_bytes(model: MoETransformer, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds between steps: its parameter shards (plus the replicated buffers)
    and its optimizer state's shards."""
    reshard(model)
    params = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    optim = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                optim += local_tensor(v).numel() * v.element_size()
    return {"params": params, "buffers": buffers, "optimizer": optim}
