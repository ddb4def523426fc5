"""The MoE transformer of a spec on a layout, by composition: the one model of
engines/torch/model.py built for this rank (layout_model), and its share of the step's objective
(ShardedLoss), computed by the one forward (engines/torch/forward.py) on every layout.

Under FSDP2 the forward runs each block as its module call (so FSDP2 gathers a block's parameters
in its forward hook, and the experts' over the data group for exactly as long as the dispatch);
the model's Experts modules hold this rank's experts and
the layout's dispatcher (engines/torch/parallel/dispatch.py: PooledWave or Ragged, given the
layout's process groups). The loss runs as the model's own call (model(tokens, ..., run=loss)), so
FSDP2's root unit gathers the embedding, final norm and head around it.
On a GPU the dense parts are compiled (the dispatch, with its collectives and host sizes, stays
eager; with ep 1 and dropless dispatch there is none, and each block compiles whole) and the
matmuls run in bf16 (FSDP2's bf16 gathers); on the CPU everything runs in fp32.

Objective. Rank r's backward seeds its share of the global objective (sum over all dp * ep ranks
= the one-device objective; engines/torch/model.sharded_objective): CE, output z-loss and router
z-loss are local means / world; the batch-scope balancing loss uses the loads summed over every
rank; sequence scope is a local mean / world. FSDP2 sums (never averages) the gradients.

Shape legend as in engines/torch/model.py, plus: b sequences of this rank.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from core.spec import ModelSpec
from engines.options import TorchKernels
from engines.torch.experts import kernels_here
from engines.torch.forward import Forward
from engines.torch.model import Experts, MoETransformer, sharded_objective
from engines.torch.dispatch import Dropless
from engines.torch.parallel.dispatch import PooledWave, Ragged, all_reduce_sum
from engines.torch.parallel.layout import Layout

EXPERT_MARK = ".moe.experts."


def is_expert_param(name: str) -> bool:
    return EXPERT_MARK in name


def layout_model(m: ModelSpec, layout: Layout) -> MoETransformer:
    """The spec's model on this rank: in each block this rank's share of the routed experts
    (E / ep of them) behind the layout's dispatcher."""
    model = MoETransformer(m)
    if m.dispatch == "capacity":
        dispatcher = PooledWave(m, layout.expert_group, layout.data_group, layout.d)
    elif layout.ep == 1:
        dispatcher = Dropless(m)  # every expert here: nothing to exchange
    else:
        dispatcher = Ragged(m, layout.expert_group)
    for blk in model.blocks:
        blk.moe.experts = Experts(m.n_routed_experts // layout.ep, m.expert_dim, m.expert_hidden, dispatcher)
    return model


class ShardedLoss:
    """This rank's share of the step's objective: the forward of a layout_model (hooked: sharded
    by FSDP2, whose units are the blocks; else replicated) and model.sharded_objective. Run as the
    model's call, model(tokens_bS1, optim, n_tokens, run=loss) -> (this rank's share of the
    objective, {"global": forward metrics summed over every rank, "aux_r", "total_r", "load_LE"})."""

    def __init__(self, model: MoETransformer, layout: Layout, kernels: TorchKernels | None = None,
                 working=None, hooked: bool = False):
        self.layout = layout
        o = kernels_here(kernels or TorchKernels())
        m = model.m
        cuda = layout.device.type == "cuda"
        # ep 1 dropless: no collective inside a block, so the whole block compiles (under FSDP2 the
        # experts then sit in their block's unit: engines/torch/parallel/fsdp.py); replicated
        # blocks (working copies at fixed addresses) are also replayed as CUDA graphs where the
        # options say so, as on one device
        whole = layout.ep == 1 and m.dispatch == "dropless"
        if not cuda or o.compile == "none":
            mode = "none"
        elif not whole:
            mode = "dense"
        else:
            mode = o.compile if working is not None and o.compile != "dense" else "block"
        self.forward = Forward(layout.device, o, working=working, compile=mode, hooked=hooked,
                            hooked_experts=layout.ep > 1 and working is None)

    def __call__(self, model: MoETransformer, tokens_bS1: torch.Tensor, optim, n_tokens: int):
        ce, z, st = self.forward.forward(model, tokens_bS1)
        return sharded_objective(ce, z, st, optim, model.m, n_tokens, self.layout.world, all_reduce_sum)


def layout_eval_losses(forward, batches, layout: Layout) -> list[float]:
    """Each eval batch's global mean CE: each rank runs its rows of the batch through
    forward(tokens_bS1, n_tokens of the whole batch) -> (objective, ShardedLoss's output)."""
    losses = []
    with torch.no_grad():
        for batch in batches:
            x = torch.from_numpy(layout.local_batch(batch)).to(layout.device, dtype=torch.long)
            _, out = forward(x, batch.shape[0] * (batch.shape[1] - 1))
            losses.append(out["global"]["loss"])
    return torch.stack(losses).float().cpu().tolist() if losses else []


def step_metrics(out: dict, aux: torch.Tensor, total: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics of model.objective (global) from the sharded objective's output and the
    balancing and total losses summed over the ranks."""
    g, load_LE = out["global"], out["load_LE"]
    return {
        "loss": g["loss"],
        "z_loss": g["z_loss"],
        "aux_loss": aux,
        "router_z_loss": g["router_z_loss"],
        "drop_frac_send": g["drop_send"],
        "drop_frac_recv": g["drop_recv"],
        "expert_load_max": (load_LE.max(-1).values / load_LE.mean(-1)).max(),
        "router_entropy": g["router_entropy"],
        "total_loss": total,
    }


def gather_experts(arrays: dict[str, np.ndarray], layout: Layout) -> dict[str, np.ndarray] | None:
    """Full arrays on expert rank 0 of the group (None elsewhere): every key naming an expert stack
    is gathered over the expert group and concatenated in rank order; the rest is taken as it is."""
    out = {}
    for k in sorted(arrays):
        a = arrays[k]
        if is_expert_param(k) and np.ndim(a) >= 1:
            t = torch.from_numpy(np.ascontiguousarray(a)).to(layout.device)
            parts = [torch.empty_like(t) for _ in range(layout.ep)]
            dist.all_gather(parts, t, group=layout.expert_group)
            if layout.e == 0:
                out[k] = np.concatenate([p.cpu().numpy() for p in parts], 0)
        elif layout.e == 0:
            out[k] = a
    return out if layout.e == 0 else None
