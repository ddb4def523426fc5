"""Reference bookkeeping of capacity-mode (pooled-wave) dispatch, in plain numpy.

This is the executable form of the semantics both engines implement (one fixed pool per
(source shard, destination shard) pair and wave on the sender side, a bound per expert on the
receiver side); engine tests compare their drop counts and kept assignments with it. It is
written for clarity, not speed.

    plan = capacity_plan(expert_TK, n_experts=E, ep=2, n_waves=1, cf_send=1.25, cf_recv=1.25)
    plan.kept_TK, plan.send_drop_TK, plan.recv_drop_TK    bool [T, K]
    plan.wave_TK, plan.row_TK                              sender pool coordinates (-1 if dropped)
    plan.recv_rank_TK                                      arrival rank at its expert (-1 if send-dropped)
    plan.c_send, plan.c_recv, plan.drop_frac_send, plan.drop_frac_recv

Rules (T tokens of the step flattened row-major, K = top_k choices per token):
- source shard of token t: t // (T // ep); destination shard of expert e: e // (E // ep);
  T % ep must be 0;
- priority (the order pools fill): slot-major, key = j * T + t;
- C_send = ceil(cf_send * (T // ep) * K / ep / W); an assignment's position p among those of
  its (src, dst) pair in priority order; p >= W * C_send is dropped at the sender, otherwise it
  travels in wave p // C_send, row p % C_send;
- C_recv = ceil(cf_recv * T * K / E); arrivals at an expert are ranked by (wave, src, row);
  rank >= C_recv is dropped at the receiver; send-dropped assignments never arrive;
- drop fractions are counts over T * K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.errors import InputError


def capacities(n_tokens: int, top_k: int, n_experts: int, ep: int, n_waves: int,
               cf_send: float, cf_recv: float) -> tuple[int, int]:
    """(C_send rows per (src, dst) pool per wave, C_recv rows per expert)."""
    if n_tokens % ep:
        raise InputError(f"capacity dispatch needs the tokens of a step ({n_tokens}) divisible by ep_size ({ep})")
    c_send = math.ceil(cf_send * (n_tokens // ep) * top_k / ep / n_waves)
    c_recv = math.ceil(cf_recv * n_tokens * top_k / n_experts)
    return c_send, c_recv


@dataclass
class CapacityPlan:
    kept_TK: np.ndarray
    send_drop_TK: np.ndarray
    recv_drop_TK: np.ndarray
    wave_TK: np.ndarray
    row_TK: np.ndarray
    recv_rank_TK: np.ndarray
    c_send: int
    c_recv: int

    @property
    def drop_frac_send(self) -> float:
        return float(self.send_drop_TK.sum()) / self.send_drop_TK.size

    @property
    def drop_frac_recv(self) -> float:
        return float(self.recv_drop_TK.sum()) / self.recv_drop_TK.size


def capacity_plan(expert_TK: np.ndarray, n_experts: int, ep: int, n_waves: int,
                  cf_send: float, cf_recv: float) -> CapacityPlan:
    expert_TK = np.asarray(expert_TK, dtype=np.int64)
    T, K = expert_TK.shape
    E = n_experts
    c_send, c_recv = capacities(T, K, E, ep, n_waves, cf_send, cf_recv)
    tokens_per_shard, experts_per_shard = T // ep, E // ep

    wave_TK = np.full((T, K), -1, np.int64)
    row_TK = np.full((T, K), -1, np.int64)
    send_drop_TK = np.zeros((T, K), bool)
    used = {}  # (src, dst) -> positions handed out so far
    for j in range(K):  # priority: slot-major, then token order
        for t in range(T):
            src, dst = t // tokens_per_shard, expert_TK[t, j] // experts_per_shard
            p = used.get((src, dst), 0)
            used[(src, dst)] = p + 1
            if p >= n_waves * c_send:
                send_drop_TK[t, j] = True
            else:
                wave_TK[t, j], row_TK[t, j] = p // c_send, p % c_send

    recv_rank_TK = np.full((T, K), -1, np.int64)
    recv_drop_TK = np.zeros((T, K), bool)
    for e in range(E):
        arrivals = [
            (wave_TK[t, j], t // tokens_per_shard, row_TK[t, j], t, j)
            for t in range(T) for j in range(K)
            if expert_TK[t, j] == e and not send_drop_TK[t, j]
        ]
        for rank, (_, _, _, t, j) in enumerate(sorted(arrivals)):
            recv_rank_TK[t, j] = rank
            recv_drop_TK[t, j] = rank >= c_recv
    kept_TK = ~send_drop_TK & ~recv_drop_TK
    return CapacityPlan(kept_TK, send_drop_TK, recv_drop_TK, wave_TK, row_TK, recv_rank_TK, c_send, c_recv)
