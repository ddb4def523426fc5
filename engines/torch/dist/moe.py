"""The MoE transformer of a spec on a (data, expert) mesh: this rank's experts, its tokens, and
its share of the step's objective.

Transport (capacity dispatch). The pooled-wave all-to-all of engines/torch/ep.py over the expert
group, with source shard e split over the dp ranks of data group e. The sender ranks an
assignment within its (wave, destination) pool over the whole source shard: its position is
(assignments of earlier slots, all dp parts) + (this slot, earlier parts) + (this slot, this part,
earlier tokens), from a [K, ep] count per part gathered over the data group; so every part fills
the rows the one-device shard would give it, in the same [W, ep, C_send] send buffer, and leaves
the others empty. The receiver ranks arrivals per local expert in (wave, source, row) order over
the arrivals of all dp replicas of its destination (their row sets are disjoint; the local
expert ids are gathered over the data group) and keeps the first C_recv; rows not its own stay
zero in its [E/ep, C_recv, L] buffer. The same drops, losses and gradients as the one-device
engine's emulated shards, for any dp. Dropless dispatch is the ragged all-to-all of ep.py over
the expert group (no capacity, so the data split changes nothing).

Objective. Rank r's backward seeds its share of the global objective (sum over all dp * ep ranks
= the one-device objective): CE, output z-loss and router z-loss are local means / world; the
batch-scope balancing loss uses the loads summed over every rank; sequence scope is a local mean
/ world. FSDP2 sums (never averages) the gradients over its meshes.

The per-rank forward is the reference forward of engines/torch/model.py (fp32 on the CPU and the
GPU; the fast path of fast.py is not used here) with the dispatchers below in each block's
Experts module: FSDP2 gathers a block's parameters in its forward hook, and the experts' over
the data group for exactly as long as the dispatch.

Shape legend as in model.py and ep.py, plus: b sequences of this rank, D_p parts of a source
shard (dp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from core.spec import ModelSpec
from engines.dispatch_ref import capacities
from engines.torch.dist.mesh import MeshContext
from engines.torch.ep import Counters, WaveExchange, all_reduce_sum, ragged_experts
from engines.torch.experts import swiglu_padded
from engines.torch.model import Experts, MoETransformer, sharded_objective
from engines.torch.rows import RowGather, group_counts, partial_inverse, rank_within


def _gather_over(t: torch.Tensor, group, n: int) -> torch.Tensor:
    """[n, *t.shape]: t of every rank of `group` in group order."""
    if n == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    Counters.all_reduce += 1
    return torch.stack(parts)


def mesh_pooled_wave(experts: Experts, x_tL: torch.Tensor, expert_tK: torch.Tensor, m: ModelSpec,
                     n_tokens: int, mc: MeshContext, cdt: torch.dtype):
    """Capacity dispatch of this rank's tokens (part d of source shard e). n_tokens: tokens of the
    whole step. Returns (y_tKL, send drops made here, receive drops made here)."""
    t, K = expert_tK.shape
    L = x_tL.shape[-1]
    P, W, Dp = mc.ep, m.n_waves, mc.dp
    e_loc = m.n_routed_experts // P
    c_send, c_recv = capacities(n_tokens, K, m.n_routed_experts, P, W, m.capacity_factor_send,
                                m.capacity_factor_recv)
    wire = cdt if (cdt == torch.float32 or e_loc <= 256) else torch.float32
    dev = x_tL.device
    # sender: assignments slot-major then token; their place in the source shard's pools
    e_A = expert_tK.t().reshape(-1)
    dst_A = e_A // e_loc
    key_A = torch.arange(K, device=dev).repeat_interleave(t) * P + dst_A  # (slot, destination)
    cnt_DKP = _gather_over(group_counts(key_A, K * P).view(K, P), mc.data_group, Dp)
    tot_KP = cnt_DKP.sum(0)
    off_KP = torch.cumsum(tot_KP, 0) - tot_KP + cnt_DKP[: mc.d].sum(0)
    pos_A = off_KP.reshape(-1)[key_A] + rank_within(key_A, K * P)
    sent_A = pos_A < W * c_send
    n_slots = W * P * c_send
    at_A = torch.where(sent_A, ((pos_A // c_send) * P + dst_A) * c_send + pos_A % c_send,
                       torch.full_like(pos_A, n_slots))
    filler_S = partial_inverse(at_A, n_slots)
    ids_S = torch.cat([(e_A - dst_A * e_loc).to(wire), x_tL.new_full((1,), -1.0, dtype=wire)])[filler_S]
    x_SL = RowGather.apply(x_tL.to(wire).repeat(K, 1), filler_S, at_A)
    send_WRL1 = torch.cat([x_SL, ids_S.unsqueeze(-1)], -1).view(W, P * c_send, L + 1)
    recv_WRL1 = WaveExchange.apply(send_WRL1, mc.expert_group)
    # receiver: arrivals ranked per local expert over every replica of this destination
    arr_XL1 = recv_WRL1.reshape(n_slots, L + 1)
    le_X = arr_XL1[:, L].detach().round().long()
    valid_X = le_X >= 0
    all_X = _gather_over(le_X, mc.data_group, Dp).amax(0)  # each row is filled on one replica at most
    rank_X = rank_within(torch.where(all_X >= 0, all_X, e_loc), e_loc + 1)
    kept_X = valid_X & (rank_X < c_recv)
    n_buf = e_loc * c_recv
    slot_X = torch.where(kept_X, le_X * c_recv + rank_X, torch.full_like(rank_X, n_buf))
    filler_B = partial_inverse(slot_X, n_buf)
    buf_eRL = RowGather.apply(arr_XL1[:, :L].to(cdt), filler_B, slot_X).view(e_loc, c_recv, L)
    out_eRL = swiglu_padded(experts, buf_eRL, cdt)
    y_WRL = RowGather.apply(out_eRL.reshape(n_buf, L).to(wire), slot_X, filler_B).view(W, P * c_send, L)
    back_WRL = WaveExchange.apply(y_WRL, mc.expert_group)
    # (token, slot) order, copied out of the transposed view: FSDP2 hooks a module output, not a view
    y_tKL = RowGather.apply(back_WRL.reshape(n_slots, L), at_A, filler_S).view(K, t, L).transpose(0, 1).contiguous()
    return y_tKL, (~sent_A).sum().float(), (valid_X & ~kept_X).sum().float()


class MeshPooledWave:
    """The capacity dispatcher over the mesh: mesh_pooled_wave, C_recv from the step's tokens
    (every rank holds the same number)."""

    sharded = True

    def __init__(self, m: ModelSpec, mc: MeshContext):
        self.m, self.mc = m, mc

    def __call__(self, kern, x_tL, expert_tK, gate_tK):
        return mesh_pooled_wave(kern.experts, x_tL, expert_tK, self.m, x_tL.shape[0] * self.mc.world, self.mc,
                                kern.cdt)


class MeshRagged:
    """The dropless dispatcher over the mesh: the ragged all-to-all of ep.py over the expert group
    (no capacity, so the data split changes nothing)."""

    sharded = True

    def __init__(self, m: ModelSpec, mc: MeshContext):
        self.m, self.mc = m, mc

    def __call__(self, kern, x_tL, expert_tK, gate_tK):
        # a copy: FSDP2 hooks the Experts module's output, which must not be a view
        y_tKL = ragged_experts(kern.gate_up(), kern.down(), x_tL, expert_tK, self.m, self.mc.ep_context(), kern.cdt,
                               kern.o).clone()
        zero = torch.zeros((), device=x_tL.device)
        return y_tKL, zero, zero


class MeshTransformer(MoETransformer):
    """The spec's model with this rank's experts and the mesh's dispatchers (the reference
    forward, fp32); forward(tokens_bS1, optim, n_tokens) -> (this rank's share of the objective,
    {"global": forward metrics summed over every rank, "aux_r", "total_r", "load_LE"}), the
    output of engines.torch.ep.EPLoss."""

    def __init__(self, m: ModelSpec, mc: MeshContext):
        super().__init__(m)
        self.mc = mc
        dispatcher = MeshPooledWave(m, mc) if m.dispatch == "capacity" else MeshRagged(m, mc)
        for blk in self.blocks:
            blk.moe.experts = Experts(m.n_routed_experts // mc.ep, m.expert_dim, m.expert_hidden, dispatcher)

    def forward(self, tokens_bS1: torch.Tensor, optim, n_tokens: int):
        inputs_bS, targets_bS = tokens_bS1[:, :-1], tokens_bS1[:, 1:]
        logits_bSV, st = super().forward(inputs_bS)
        lse_bS = torch.logsumexp(logits_bSV, -1)
        ce = (lse_bS - logits_bSV.gather(-1, targets_bS.unsqueeze(-1)).squeeze(-1)).mean()
        z = lse_bS.square().mean()
        return sharded_objective(ce, z, st, optim, self.m, n_tokens, self.mc.world,
                                 lambda t: all_reduce_sum(t, _World(self.mc)))


class _World:
    """The whole mesh as an all-reduce group (ep.all_reduce_sum's view of a context)."""

    def __init__(self, mc: MeshContext):
        self.size, self.group = mc.world, None
