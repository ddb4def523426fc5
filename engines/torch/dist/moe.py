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

The per-rank forward calls each block as a module (FSDP2 gathers a block's parameters in its
forward hook), in fp32 on the CPU with model.py's layers; the GPU fast path of fast.py is not used
here.

Shape legend as in model.py and ep.py, plus: b sequences of this rank, D_p parts of a source
shard (dp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engines.dispatch_ref import capacities
from engines.torch.ep import (
    FORWARD_KEYS,
    Counters,
    RowGather,
    _rank_within,
    _router_probs,
    _swiglu_padded,
    _WaveExchange,
    all_reduce_sum,
    ragged_experts,
)
from engines.torch.dist.mesh import MeshContext
from engines.torch.model import (
    Block,
    Experts,
    MoETransformer,
    attention_mask,
    group_counts,
    partial_inverse,
    rope_tables,
)
from core.spec import ModelSpec


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
    pos_A = off_KP.reshape(-1)[key_A] + _rank_within(key_A, K * P)
    sent_A = pos_A < W * c_send
    n_slots = W * P * c_send
    at_A = torch.where(sent_A, ((pos_A // c_send) * P + dst_A) * c_send + pos_A % c_send,
                       torch.full_like(pos_A, n_slots))
    filler_S = partial_inverse(at_A, n_slots)
    ids_S = torch.cat([(e_A - dst_A * e_loc).to(wire), x_tL.new_full((1,), -1.0, dtype=wire)])[filler_S]
    x_SL = RowGather.apply(x_tL.to(wire).repeat(K, 1), filler_S, at_A)
    send_WRL1 = torch.cat([x_SL, ids_S.unsqueeze(-1)], -1).view(W, P * c_send, L + 1)
    recv_WRL1 = _WaveExchange.apply(send_WRL1, mc.expert_group)
    # receiver: arrivals ranked per local expert over every replica of this destination
    arr_XL1 = recv_WRL1.reshape(n_slots, L + 1)
    le_X = arr_XL1[:, L].detach().round().long()
    valid_X = le_X >= 0
    all_X = _gather_over(le_X, mc.data_group, Dp).amax(0)  # each row is filled on one replica at most
    rank_X = _rank_within(torch.where(all_X >= 0, all_X, e_loc), e_loc + 1)
    kept_X = valid_X & (rank_X < c_recv)
    n_buf = e_loc * c_recv
    slot_X = torch.where(kept_X, le_X * c_recv + rank_X, torch.full_like(rank_X, n_buf))
    filler_B = partial_inverse(slot_X, n_buf)
    buf_eRL = RowGather.apply(arr_XL1[:, :L].to(cdt), filler_B, slot_X).view(e_loc, c_recv, L)
    out_eRL = _swiglu_padded(experts, buf_eRL, cdt)
    y_WRL = RowGather.apply(out_eRL.reshape(n_buf, L).to(wire), slot_X, filler_B).view(W, P * c_send, L)
    back_WRL = _WaveExchange.apply(y_WRL, mc.expert_group)
    # (token, slot) order, copied out of the transposed view: FSDP2 hooks a module output, not a view
    y_tKL = RowGather.apply(back_WRL.reshape(n_slots, L), at_A, filler_S).view(K, t, L).transpose(0, 1).contiguous()
    return y_tKL, (~sent_A).sum().float(), (valid_X & ~kept_X).sum().float()


class MeshExperts(Experts):
    """This rank's routed experts; its forward is the whole dispatch, so FSDP2 gathers the expert
    weights over the data group for exactly that long."""

    def __init__(self, m: ModelSpec, mc: MeshContext):
        super().__init__(m.n_routed_experts // mc.ep, m.expert_dim, m.expert_hidden)
        self.m, self.mc = m, mc

    def forward(self, x_tL: torch.Tensor, expert_tK: torch.Tensor, n_tokens: int, cdt: torch.dtype):
        m, mc = self.m, self.mc
        if m.dispatch == "capacity":
            return mesh_pooled_wave(self, x_tL, expert_tK, m, n_tokens, mc, cdt)
        w_gu = torch.cat([self.w_gate, self.w_up], -1).to(cdt)
        y_tKL = ragged_experts(w_gu, self.w_down.to(cdt), x_tL, expert_tK, m, mc.ep_context(), cdt).clone()
        zero = torch.zeros((), device=x_tL.device)
        return y_tKL, zero, zero


class MeshBlock(Block):
    """model.Block with the routed experts dispatched over the mesh."""

    def __init__(self, m: ModelSpec, mc: MeshContext):
        super().__init__(m)
        self.moe.experts = MeshExperts(m, mc)

    def forward(self, x_bSD, cos, sin, mask_SS, n_tokens: int, cdt: torch.dtype):
        b, S, D = x_bSD.shape
        moe, m = self.moe, self.moe.m
        x_bSD = x_bSD + self.attn(self.attn_norm(x_bSD), cos, sin, mask_SS)
        h_TD = self.moe_norm(x_bSD).reshape(b * S, D)
        expert_TK, gate_TK, st = moe.route(h_TD, S)
        x_TL = h_TD @ moe.latent_down if m.latent_dim is not None else h_TD
        y_TKL, n_send, n_recv = moe.experts(x_TL, expert_TK, n_tokens, cdt)
        y_TL = (y_TKL * gate_TK.unsqueeze(-1).to(y_TKL.dtype)).sum(1)
        y_TD = y_TL @ moe.latent_up if m.latent_dim is not None else y_TL
        if m.n_shared_experts > 0:
            y_TD = y_TD + moe.shared(h_TD)
        st["probs_sum"] = _router_probs(moe, h_TD).sum(0) if m.balance_scope == "batch" else None
        st["drop_send"], st["drop_recv"] = n_send, n_recv
        return x_bSD + y_TD.view(b, S, D), st


class MeshTransformer(MoETransformer):
    """The spec's model with MeshBlocks; forward(tokens_bS1, optim, n_tokens) -> (this rank's
    share of the objective, {"global": forward metrics summed over every rank, "aux_r", "total_r",
    "load_LE"}), the output of engines.torch.ep.EPLoss."""

    def __init__(self, m: ModelSpec, mc: MeshContext):
        super().__init__(m)
        self.mc = mc
        self.blocks = torch.nn.ModuleList(MeshBlock(m, mc) for _ in range(m.n_layers))
        self._tables: dict = {}

    def forward(self, tokens_bS1: torch.Tensor, optim, n_tokens: int):
        m, mc = self.m, self.mc
        n = mc.world
        cdt = torch.float32
        inputs_bS, targets_bS = tokens_bS1[:, :-1], tokens_bS1[:, 1:]
        S = inputs_bS.shape[1]
        if S not in self._tables:
            cos, sin = rope_tables(S, m.head_dim, m.rope_theta, tokens_bS1.device)
            self._tables[S] = (cos, sin, attention_mask(S, m.attention_window, tokens_bS1.device))
        cos, sin, mask_SS = self._tables[S]
        x_bSD = self.embed.weight[inputs_bS]
        stats = []
        for block in self.blocks:
            x_bSD, st = block(x_bSD, cos, sin, mask_SS, n_tokens, cdt)
            stats.append(st)
        logits_bSV = (self.final_norm(x_bSD) @ self.lm_head).float()
        lse_bS = torch.logsumexp(logits_bSV, -1)
        ce = (lse_bS - logits_bSV.gather(-1, targets_bS.unsqueeze(-1)).squeeze(-1)).mean()
        z = lse_bS.square().mean()
        n_layers, K, E = len(self.blocks), m.top_k, m.n_routed_experts
        router_z = torch.stack([s["router_z"] for s in stats]).mean()
        fwd = torch.cat([
            torch.stack([ce.detach() / n, z.detach() / n, router_z.detach() / n,
                         torch.stack([s["entropy"] for s in stats]).mean() / n,
                         torch.stack([s["drop_send"] for s in stats]).sum() / (n_tokens * K * n_layers),
                         torch.stack([s["drop_recv"] for s in stats]).sum() / (n_tokens * K * n_layers)]).float(),
            torch.stack([s["load"] for s in stats]).float().reshape(-1)])
        fwd = all_reduce_sum(fwd, _World(mc))
        g = dict(zip(FORWARD_KEYS, fwd[: len(FORWARD_KEYS)]))
        load_LE = fwd[len(FORWARD_KEYS):].view(n_layers, E)
        if m.balance_scope == "batch":
            f_LE = load_LE / (n_tokens * K)
            aux_r = (E * (f_LE * torch.stack([s["probs_sum"] for s in stats])).sum(-1) / n_tokens).mean()
        else:
            aux_r = torch.stack([s["aux"] for s in stats]).mean() / n
        total_r = (ce + optim.z_loss * z + optim.router_z_loss * router_z) / n + optim.aux_loss * aux_r
        return total_r, {"global": g, "aux_r": aux_r.detach(), "total_r": total_r.detach(), "load_LE": load_LE}


class _World:
    """The whole mesh as an all-reduce group (ep.all_reduce_sum's view of a context)."""

    def __init__(self, mc: MeshContext):
        self.size, self.group = mc.world, None
