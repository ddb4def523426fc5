"""Token dispatchers across processes: how a block's routed assignments reach the ranks that hold
their experts and come back. Each takes its process groups when it is built (the expert group of
the layout, and for capacity dispatch its data group) and has torchtitan's token-dispatcher
shape: dispatch (rows to the experts' ranks, with the plan to bring them back), the experts on
the received rows, combine (the outputs back in (token, slot) order). A block calls one as
dispatcher(kern, x_tL, expert_tK, gate_tK) -> (y_tKL, send drops made here, receive drops made
here), as the one-device dispatchers of engines/torch/dispatch.py.

PooledWave (capacity). The pooled-wave transport of engines/dispatch_ref.py over real ranks: per
wave one fixed-shape send buffer [ep, C_send, L + 1] (the destination-local expert id in the last
column, -1 in unused rows) goes through dist.all_to_all_single; the receiver ranks its arrivals
per local expert in (wave, source, row) order, keeps at most C_recv, runs its experts on a fixed
[E/ep, C_recv, L] buffer, and the outputs go back the same way. With dp > 1, source shard e is
split over the dp ranks of data group e: the sender ranks an assignment within its (wave,
destination) pool over the whole source shard (its position is (assignments of earlier slots,
all dp parts) + (this slot, earlier parts) + (this slot, this part, earlier tokens), from a
[K, ep] count per part gathered over the data group), so every part fills the rows the
one-device shard would give it; the receiver ranks arrivals over all dp replicas of its
destination (their row sets are disjoint; the local expert ids are gathered over the data group)
and keeps the first C_recv. The same drops, losses and gradients as the one-device engine's
emulated shards (engines/torch/dispatch.Capacity), for any dp.

Ragged (dropless). Counts per (destination, local expert) first, then the rows with variable
split sizes (one host sync per layer for the sizes); no capacity, so the data split changes
nothing. With an expert group of one (ep = 1: every expert on every rank, data parallel only)
nothing is exchanged: the one-device dispatch (engines/torch/dispatch.Dropless) with its gather
kernels and no host sync takes its place.

Outputs are copies, never views: FSDP2 hooks the Experts module's output.

Shape legend as in engines/torch/model.py, plus: t tokens of this rank, e experts of this rank,
P ranks of the expert group (ep), W waves, C sender rows per pool, X arrivals at this rank
(W * P * C), R receiver rows per expert, D_p ranks of the data group (dp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.spec import ModelSpec
from engines.dispatch_ref import capacities
from engines.torch.experts import grouped_swiglu, swiglu_padded
from engines.torch.rows import RowGather, group_counts, partial_inverse, rank_within


class Counters:
    """Collective calls made by this process (the run summary reports them)."""

    all_to_all = 0
    all_reduce = 0


# ---- collectives with autograd ------------------------------------------------------------------


def _a2a_waves(x_WRL: torch.Tensor, group) -> torch.Tensor:
    """One all_to_all_single per wave, every wave the same shape (all in flight at once)."""
    x_WRL = x_WRL.contiguous()
    out = torch.empty_like(x_WRL)
    works = [dist.all_to_all_single(out[w], x_WRL[w], group=group, async_op=True) for w in range(x_WRL.shape[0])]
    for h in works:
        h.wait()
    Counters.all_to_all += len(works)
    return out


class WaveExchange(torch.autograd.Function):
    """Fixed-split all-to-all per wave; with equal splits its transpose is itself, so the
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x_WRL, group):
        ctx.group = group
        return _a2a_waves(x_WRL, group)

    @staticmethod
    def backward(ctx, g_WRL):
        return _a2a_waves(g_WRL, ctx.group), None


def _a2a_ragged(x_NL: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    out = x_NL.new_empty((sum(out_rows), x_NL.shape[-1]))
    dist.all_to_all_single(out, x_NL.contiguous(), output_split_sizes=out_rows, input_split_sizes=in_rows,
                           group=group)
    Counters.all_to_all += 1
    return out


class RaggedExchange(torch.autograd.Function):
    """All-to-all with variable split sizes; the backward swaps input and output sizes."""

    @staticmethod
    def forward(ctx, x_NL, send_rows, recv_rows, group):
        ctx.sizes, ctx.group = (send_rows, recv_rows), group
        return _a2a_ragged(x_NL, recv_rows, send_rows, group)

    @staticmethod
    def backward(ctx, g_ML):
        send_rows, recv_rows = ctx.sizes
        return _a2a_ragged(g_ML, send_rows, recv_rows, ctx.group), None, None, None


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """t summed over `group` (None: every rank), in place."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        Counters.all_reduce += 1
    return t


def gather_over(t: torch.Tensor, group, n: int) -> torch.Tensor:
    """[n, *t.shape]: t of every rank of `group` in group order."""
    if n == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    Counters.all_reduce += 1
    return torch.stack(parts)


# ---- pooled waves (capacity) --------------------------------------------------------------------


@dataclass
class WavePlan:
    """What dispatch learned that combine needs: each sent assignment's send-buffer row (at_A, the
    empty row n_slots if dropped), the assignment filling each row (filler_S), and at the
    receiver each arrival's expert-buffer row (slot_X) and the arrival filling each (filler_B)."""

    t: int
    K: int
    at_A: torch.Tensor
    filler_S: torch.Tensor
    slot_X: torch.Tensor
    filler_B: torch.Tensor
    n_send: torch.Tensor
    n_recv: torch.Tensor


class PooledWave:
    """The capacity dispatcher over the ranks of `expert_group` (ep of them), this rank being part
    d of dp of its source shard (`data_group`: the dp replicas of its expert shard; None for
    dp = 1). C_recv from the step's tokens: every rank holds the same number."""


    def __init__(self, m: ModelSpec, expert_group, data_group=None, d: int = 0):
        self.m, self.expert_group, self.data_group, self.d = m, expert_group, data_group, d
        self.ep = dist.get_world_size(expert_group)
        self.dp = 1 if data_group is None else dist.get_world_size(data_group)

    def __call__(self, kern, x_tL, expert_tK, gate_tK):
        cdt = kern.cdt
        # bf16 holds every integer up to 256 exactly: larger local expert ids ride in fp32 rows
        e_loc = self.m.n_routed_experts // self.ep
        wire = cdt if (cdt == torch.float32 or e_loc <= 256) else torch.float32
        buf_eRL, plan = self.dispatch(x_tL.to(cdt), expert_tK, x_tL.shape[0] * self.ep * self.dp, wire, cdt)
        out_eRL = swiglu_padded(kern.experts, buf_eRL, cdt)
        return self.combine(out_eRL.to(wire), plan), plan.n_send, plan.n_recv

    def dispatch(self, x_tL, expert_tK, n_tokens: int, wire: torch.dtype, cdt: torch.dtype):
        """(the [e, C_recv, L] expert buffers of this rank in cdt, the plan). n_tokens: tokens of
        the whole step (all ranks), which sets C_recv; wire: the rows' dtype on the wire."""
        m, P, Dp = self.m, self.ep, self.dp
        t, K = expert_tK.shape
        L, W = x_tL.shape[-1], m.n_waves
        e_loc = m.n_routed_experts // P
        c_send, c_recv = capacities(n_tokens, K, m.n_routed_experts, P, W, m.capacity_factor_send,
                                    m.capacity_factor_recv)
        dev = x_tL.device
        # sender: assignments slot-major then token; their place in the source shard's pools
        e_A = expert_tK.t().reshape(-1)
        dst_A = e_A // e_loc
        key_A = torch.arange(K, device=dev).repeat_interleave(t) * P + dst_A  # (slot, destination)
        cnt_DKP = gather_over(group_counts(key_A, K * P).view(K, P), self.data_group, Dp)
        tot_KP = cnt_DKP.sum(0)
        off_KP = torch.cumsum(tot_KP, 0) - tot_KP + cnt_DKP[: self.d].sum(0)
        pos_A = off_KP.reshape(-1)[key_A] + rank_within(key_A, K * P)
        sent_A = pos_A < W * c_send
        n_slots = W * P * c_send
        # flat index of each sent assignment in the [W, P, C] buffer; n_slots (an empty row) if dropped
        at_A = torch.where(sent_A, ((pos_A // c_send) * P + dst_A) * c_send + pos_A % c_send,
                           torch.full_like(pos_A, n_slots))
        filler_S = partial_inverse(at_A, n_slots)  # the assignment filling each slot
        ids_S = torch.cat([(e_A - dst_A * e_loc).to(wire), x_tL.new_full((1,), -1.0, dtype=wire)])[filler_S]
        # x_tL[tok_A] for slot-major assignments; repeat's backward sums the K slots
        x_SL = RowGather.apply(x_tL.to(wire).repeat(K, 1), filler_S, at_A)
        send_WRL1 = torch.cat([x_SL, ids_S.unsqueeze(-1)], -1).view(W, P * c_send, L + 1)
        recv_WRL1 = WaveExchange.apply(send_WRL1, self.expert_group)
        # receiver: arrivals in (wave, source, row) order, ranked per local expert over every
        # replica of this destination (each row is filled on one replica at most)
        arr_XL1 = recv_WRL1.reshape(n_slots, L + 1)
        le_X = arr_XL1[:, L].detach().round().long()
        valid_X = le_X >= 0
        all_X = gather_over(le_X, self.data_group, Dp).amax(0)
        rank_X = rank_within(torch.where(all_X >= 0, all_X, e_loc), e_loc + 1)
        kept_X = valid_X & (rank_X < c_recv)
        n_buf = e_loc * c_recv
        slot_X = torch.where(kept_X, le_X * c_recv + rank_X, torch.full_like(rank_X, n_buf))
        filler_B = partial_inverse(slot_X, n_buf)  # the arrival filling each buffer row
        buf_eRL = RowGather.apply(arr_XL1[:, :L].to(cdt), filler_B, slot_X).view(e_loc, c_recv, L)
        plan = WavePlan(t=t, K=K, at_A=at_A, filler_S=filler_S, slot_X=slot_X, filler_B=filler_B,
                        n_send=(~sent_A).sum().float(), n_recv=(valid_X & ~kept_X).sum().float())
        return buf_eRL, plan

    def combine(self, out_eRL: torch.Tensor, plan: WavePlan) -> torch.Tensor:
        """y_tKL in (token, slot) order: zero rows for assignments dropped anywhere."""
        L = out_eRL.shape[-1]
        n_slots = plan.filler_S.shape[0]
        y_WRL = RowGather.apply(out_eRL.reshape(-1, L), plan.slot_X, plan.filler_B).view(self.m.n_waves, -1, L)
        back_WRL = WaveExchange.apply(y_WRL, self.expert_group)  # unkept and empty rows carry zeros back
        return (RowGather.apply(back_WRL.reshape(n_slots, L), plan.at_A, plan.filler_S)
                .view(plan.K, plan.t, L).transpose(0, 1).contiguous())


# ---- ragged (dropless) --------------------------------------------------------------------------


@dataclass
class RaggedPlan:
    order_A: torch.Tensor  # the assignments sorted by global expert = by (destination, local expert)
    order_N: torch.Tensor  # the arrivals sorted by local expert
    send_rows: list[int]
    recv_rows: list[int]
    t: int
    K: int


class Ragged:
    """The dropless dispatcher over the ranks of `expert_group`: every assignment reaches its
    expert through a variable-size all-to-all."""


    def __init__(self, m: ModelSpec, expert_group):
        self.m, self.expert_group = m, expert_group
        self.ep = dist.get_world_size(expert_group)

    def __call__(self, kern, x_tL, expert_tK, gate_tK):
        x_NL, counts_e, plan = self.dispatch(x_tL.to(kern.cdt), expert_tK)
        y_NL = grouped_swiglu(x_NL, counts_e, kern.gate_up(), kern.down(), kern.cdt, kern.o)
        zero = torch.zeros((), device=x_tL.device)
        return self.combine(y_NL, plan), zero, zero

    def dispatch(self, x_tL, expert_tK):
        """(the arrivals sorted by local expert, rows per local expert, the plan)."""
        t, K = expert_tK.shape
        P = self.ep
        e_loc = self.m.n_routed_experts // P
        e_A = expert_tK.reshape(-1)  # token-major: a = token * K + slot
        order_A = torch.argsort(e_A, stable=True)
        counts_E = group_counts(e_A, self.m.n_routed_experts)
        recv_counts_E = torch.empty_like(counts_E)  # [P sources, e local experts] once reshaped
        dist.all_to_all_single(recv_counts_E, counts_E, group=self.expert_group)
        Counters.all_to_all += 1
        send_rows, recv_rows = torch.stack([counts_E.view(P, e_loc).sum(1), recv_counts_E.view(P, e_loc).sum(1)]).tolist()
        x_NL = RaggedExchange.apply(x_tL[order_A // K], send_rows, recv_rows, self.expert_group)
        le_N = torch.repeat_interleave(torch.arange(e_loc, device=x_tL.device).repeat(P), recv_counts_E)
        order_N = torch.argsort(le_N, stable=True)
        plan = RaggedPlan(order_A=order_A, order_N=order_N, send_rows=send_rows, recv_rows=recv_rows, t=t, K=K)
        return x_NL[order_N], group_counts(le_N, e_loc), plan

    def combine(self, y_sorted_NL: torch.Tensor, plan: RaggedPlan) -> torch.Tensor:
        """y_tKL in (token, slot) order."""
        y_NL = torch.empty_like(y_sorted_NL).index_copy(0, plan.order_N, y_sorted_NL)
        y_sorted_AL = RaggedExchange.apply(y_NL, plan.recv_rows, plan.send_rows, self.expert_group)
        y_AL = torch.empty_like(y_sorted_AL).index_copy(0, plan.order_A, y_sorted_AL)
        return y_AL.view(plan.t, plan.K, -1).clone()  # a copy: FSDP2 hooks the module output, not a view
