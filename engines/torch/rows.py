"""Row bookkeeping every token dispatcher shares: counts and ranks within groups (on the device,
no host sync), the partial inverse of a row map, and row permutations whose backward is a
gather (no atomics, no accumulation into a shared zero row).

Shape legend: A assignments (T*K), T tokens, K top-k, L row width, N rows read, M rows written,
R expert-buffer rows, G groups.
"""

from __future__ import annotations

import torch

from engines.torch.kernels.gather import gather_sum


def group_counts(group_A: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Rows per group (int64) by scatter-add: CUDA's bincount reads its maximum back to the host."""
    return torch.zeros(n_groups, dtype=torch.long, device=group_A.device).scatter_add_(
        0, group_A, torch.ones_like(group_A))


def rank_within(group_A: torch.Tensor, n_groups: int) -> torch.Tensor:
    """How many earlier rows (in the given order) share each row's group; stays on the device."""
    A = group_A.shape[0]
    order_A = torch.argsort(group_A, stable=True)
    counts_G = group_counts(group_A, n_groups)
    starts_G = torch.cumsum(counts_G, 0) - counts_G
    rank_sorted = torch.arange(A, device=group_A.device) - starts_G[group_A[order_A]]
    return torch.empty_like(rank_sorted).scatter_(0, order_A, rank_sorted)


def partial_inverse(idx_M: torch.Tensor, N: int) -> torch.Tensor:
    """For each of N rows, the position in idx_M that names it (idx_M names each row of [0, N) at
    most once; N, a zero row, any number of times), or M where none does."""
    M = idx_M.shape[0]
    inv = torch.full((N + 1,), M, dtype=torch.long, device=idx_M.device)
    inv.scatter_(0, idx_M, torch.arange(M, device=idx_M.device))  # the zero row's readers all land on N
    return inv[:N]


def with_zero_row(x_NL: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_NL, x_NL.new_zeros(1, x_NL.shape[-1])], 0)


class Dispatch(torch.autograd.Function):
    """x_TL rows src_R (= token of each sorted assignment, or of each expert-buffer row) -> x_RL;
    the backward gathers the gradient back to (token, slot) order with inv_A (each assignment's
    row) and sums the K slots (with kernels: engines/torch/kernels/gather.py's gather-and-sum in one pass).
    zero_row: src_R may name row T, a zero row (an unfilled buffer row), and inv_A row R (a dropped
    assignment, which gets no gradient). Without the explicit backward, aten's and Inductor's
    backward of x[src] accumulate into x, and every unfilled row adds into the same zero row."""

    @staticmethod
    def forward(ctx, x_TL, src_R, inv_A, K: int, kernels: bool = False, zero_row: bool = False):
        ctx.save_for_backward(inv_A)
        ctx.K, ctx.kernels, ctx.zero_row = K, kernels, zero_row
        return (with_zero_row(x_TL) if zero_row else x_TL).index_select(0, src_R)

    @staticmethod
    def backward(ctx, g_RL):
        (inv_A,) = ctx.saved_tensors
        T = inv_A.shape[0] // ctx.K
        g = with_zero_row(g_RL) if ctx.zero_row else g_RL
        if ctx.kernels:
            return gather_sum(g, inv_A.view(T, ctx.K), None, g.dtype), None, None, None, None, None
        return g.index_select(0, inv_A).view(T, ctx.K, -1).sum(1), None, None, None, None, None


class RowGather(torch.autograd.Function):
    """y_ML = [x_NL; 0][idx_M] where every row of x is read at most once: inv_N is idx's partial
    inverse (the output row reading each x row, M if none), so the backward is the gather
    [g_ML; 0][inv_N]. Aten's backward of x[idx] accumulates into x with a sort per index, and
    when every unfilled row reads the same zero row, its kernel walks hundreds of thousands of
    duplicates one by one (about 120 ms a call on an H200, in the expert-parallel trainer)."""

    @staticmethod
    def forward(ctx, x_NL, idx_M, inv_N):
        ctx.save_for_backward(inv_N)
        return with_zero_row(x_NL).index_select(0, idx_M)

    @staticmethod
    def backward(ctx, g_ML):
        (inv_N,) = ctx.saved_tensors
        return with_zero_row(g_ML).index_select(0, inv_N), None, None


class Permute(torch.autograd.Function):
    """y = x[idx] for a permutation idx whose inverse is inv; backward g[inv]."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None
