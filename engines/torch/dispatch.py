"""Token dispatchers on one device: how a block's routed assignments reach their experts and come
back. A MoE block routes its tokens and hands the rows and the routing to the dispatcher its
Experts module holds; the dispatcher decides which row goes where and runs the experts through a
kernel set (engines/torch/experts.py). Expert parallel swaps the dispatcher, nothing else:
engines/torch/parallel/dispatch.py (PooledWave, Ragged: across the processes of a data x
expert layout).

Every dispatcher is called as dispatcher(kern, x_TL, expert_TK, gate_TK) and returns (y, n_send,
n_recv): y is y_TKL, every assignment's expert output in (token, slot) order (zeros for a dropped
one), or y_TL, already summed with its gates (CastKernels with the gather kernels); n_send and
n_recv are the assignments dropped at the sender and the receiver (float 0-d tensors).

- Dropless: the assignments sorted by expert, one grouped SwiGLU, the inverse permutation.
- Capacity: the pooled-wave semantics written out in engines/dispatch_ref.py (sender pools per
  shard pair and wave, a receiver bound per expert), the EP shards emulated on one device with
  fixed-shape [E, C_recv, L] expert buffers. With no drops it equals Dropless.

Routing metadata stays on the device: no host sync except the CPU expert loop.

Shape legend: T tokens, K top-k, A assignments (T*K), P priority order (slot-major, p = j*T + t),
E experts, C receiver rows per expert, L expert width.
"""

from __future__ import annotations

import torch

from core.spec import ModelSpec
from engines.dispatch_ref import capacities
from engines.torch.rows import group_counts, partial_inverse, rank_within


def capacity_plan(expert_TK: torch.Tensor, n_experts: int, ep: int, n_waves: int, cf_send: float,
                  cf_recv: float) -> dict[str, torch.Tensor | int]:
    """Pooled-wave bookkeeping on the device (same rules as engines/dispatch_ref.py):
    kept_TK, send_drop_TK, recv_drop_TK (bool), slot_TK (row e * C + rank in the [E*C] expert
    buffers; E*C, one past the end, for dropped assignments), c_send, c_recv."""
    T, K = expert_TK.shape
    E = n_experts
    c_send, c_recv = capacities(T, K, E, ep, n_waves, cf_send, cf_recv)
    dev = expert_TK.device
    # priority order: slot-major, then token (p = j * T + t)
    e_P = expert_TK.t().reshape(-1)
    t_P = torch.arange(T, device=dev).repeat(K)
    src_P = t_P // (T // ep)
    dst_P = e_P // (E // ep)
    pos_P = rank_within(src_P * ep + dst_P, ep * ep)
    send_drop_P = pos_P >= n_waves * c_send
    wave_P, row_P = pos_P // c_send, pos_P % c_send
    # arrivals at an expert in (wave, source, row) order; send-dropped rows sort after all arrivals
    n_keys = n_waves * ep * c_send
    key_P = torch.where(send_drop_P, torch.full_like(pos_P, n_keys), (wave_P * ep + src_P) * c_send + row_P)
    order_P = torch.argsort(e_P * (n_keys + 1) + key_P, stable=True)
    counts_E = group_counts(e_P, E)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = torch.arange(T * K, device=dev) - starts_E[e_P[order_P]]
    rank_P = torch.empty_like(rank_sorted).scatter_(0, order_P, rank_sorted)
    recv_drop_P = ~send_drop_P & (rank_P >= c_recv)
    kept_P = ~send_drop_P & ~recv_drop_P
    slot_P = torch.where(kept_P, e_P * c_recv + rank_P, torch.full_like(rank_P, E * c_recv))

    def tk(a_P):
        return a_P.view(K, T).t()

    return {"kept_TK": tk(kept_P), "send_drop_TK": tk(send_drop_P), "recv_drop_TK": tk(recv_drop_P),
            "slot_TK": tk(slot_P), "c_send": c_send, "c_recv": c_recv}


def capacity_rows(m: ModelSpec, expert_TK: torch.Tensor):
    """(plan, slot_A, fill_R): the pooled-wave plan of capacity_plan, each assignment's row in the
    [E, C] expert buffers (E*C for a dropped one), and for each of the E*C rows the assignment that
    fills it (T*K, a zero row, for rows nobody fills)."""
    E = m.n_routed_experts
    plan = capacity_plan(expert_TK, E, m.ep_size, m.n_waves, m.capacity_factor_send, m.capacity_factor_recv)
    R = E * plan["c_recv"]
    slot_A = plan["slot_TK"].reshape(-1)
    return plan, slot_A, partial_inverse(slot_A, R)


class Dropless:
    """Every assignment reaches its expert: sorted by expert, one grouped SwiGLU, unsorted."""


    def __init__(self, m: ModelSpec):
        self.m = m

    def __call__(self, kern, x_TL, expert_TK, gate_TK):
        K = expert_TK.shape[1]
        e_A = expert_TK.reshape(-1)  # token-major: a = t * K + j
        order_A = torch.argsort(e_A, stable=True)
        inv_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(e_A.shape[0], device=e_A.device))
        counts_E = group_counts(e_A, self.m.n_routed_experts)
        y_sorted_AL = kern.sorted_experts(x_TL, order_A, inv_A, K, counts_E)
        zero = torch.zeros((), device=x_TL.device)
        return kern.unsort(y_sorted_AL, order_A, inv_A, gate_TK), zero, zero


class Capacity:
    """The pooled-wave rules with the model.ep_size shards emulated on this device."""


    def __init__(self, m: ModelSpec):
        self.m = m

    def __call__(self, kern, x_TL, expert_TK, gate_TK):
        T, K = expert_TK.shape
        E, L = self.m.n_routed_experts, x_TL.shape[-1]
        plan, slot_A, fill_R = capacity_rows(self.m, expert_TK)
        C = plan["c_recv"]
        buf_ECL = kern.fill(x_TL, fill_R, slot_A, K).view(E, C, L)
        out_ECL = kern.padded(buf_ECL)
        y_TKL = kern.read(out_ECL.reshape(E * C, L), slot_A, fill_R).view(T, K, L)
        return y_TKL, plan["send_drop_TK"].sum().float(), plan["recv_drop_TK"].sum().float()


def local_dispatcher(m: ModelSpec) -> Dropless | Capacity:
    """The one-device dispatcher of model.dispatch."""
    return Capacity(m) if m.dispatch == "capacity" else Dropless(m)
