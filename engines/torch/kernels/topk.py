"""The router's top-k as one Triton kernel (kernels topk="triton"): each token's K highest
selection scores over its E experts.

torch.topk on [T, E] fp32 rows ran as `sbtopk::gatherTopK`, a radix select per row: 5.1-5.2 ms of a
110-136 ms H200 step at Marin's d768 shape (E 384, K 8, T 32,768 over 8 layers), for reading 50 MB
a layer. Here each program holds a [BLOCK_T, BLOCK_E] tile of rows in registers and takes K
rounds of (row max, the lowest column holding it, that column set to -inf): one read of the
scores, K writes of the indices.

It selects what torch.topk selects, in the same order (highest score first). Only ties differ:
torch.topk leaves their order unspecified, the kernel takes the lowest expert first. Scores are
finite in a healthy run (softmax or sigmoid, plus a finite balancing bias); a NaN score (weights a
non-finite update reached) ranks below every number, so the indices stay in [0, E) and the step
ends in a non-finite loss the trainer reports, not in a device-side index assert. On the CPU, or without Triton, it is
torch.topk.

Shape legend: T tokens, E experts, K top-k.
"""

from __future__ import annotations

import torch

from engines.torch.kernels.ops import register_triton_ops, tl, triton

TILE = 8192  # elements a program holds: BLOCK_T rows of BLOCK_E columns

if triton is not None:

    @triton.jit
    def topk_kernel(x_ptr, idx_ptr, T, E, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < T
        col_ok = (cols < E)[None, :]
        x = tl.load(x_ptr + rows[:, None] * E + cols[None, :], mask=row_ok[:, None] & col_ok,
                    other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # NaN scores (a diverged router) rank last: indices stay in [0, E)
        for j in tl.static_range(K):
            best = tl.max(x, axis=1)
            at = tl.min(tl.where((x == best[:, None]) & col_ok, cols[None, :], BLOCK_E), axis=1)
            tl.store(idx_ptr + rows * K + j, at.to(tl.int64), mask=row_ok)
            x = tl.where(cols[None, :] == at[:, None], float("-inf"), x)


def launch_topk(x_TE: torch.Tensor, idx_TK: torch.Tensor, wrap=lambda k: k) -> None:
    """idx_TK = the columns of each row's K largest values of x_TE, largest first (contiguous)."""
    T, E = x_TE.shape
    K = idx_TK.shape[1]
    if idx_TK.shape[0] != T or not 0 < K <= E or idx_TK.dtype != torch.int64:
        raise ValueError(f"topk: scores {tuple(x_TE.shape)}, indices {tuple(idx_TK.shape)} {idx_TK.dtype} "
                         f"(want [T, E] and [T, K] int64, 0 < K <= E)")
    if T == 0:
        return
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(TILE // block_e, triton.next_power_of_2(T)))
    wrap(topk_kernel)[(triton.cdiv(T, block_t),)](x_TE, idx_TK, T, E, K=K, BLOCK_T=block_t, BLOCK_E=block_e,
                                                   num_warps=8 if block_t * block_e >= 4096 else 4)


_OPS = False
if triton is not None:

    def _topk_op(x_TE: torch.Tensor, k: int) -> torch.Tensor:
        idx_TK = torch.empty(x_TE.shape[0], k, device=x_TE.device, dtype=torch.int64)
        launch_topk(x_TE, idx_TK, wrap=torch.library.wrap_triton)
        return idx_TK

    _OPS = register_triton_ops("engines/torch/kernels/topk.py", "torch.topk runs", {"moe_ladder::router_topk": _topk_op})


def topk_indices(select_TE: torch.Tensor, k: int, use_kernel: bool = True) -> torch.Tensor:
    """[T, K] int64: the K highest-scoring experts of each row, highest first (no gradient)."""
    select_TE = select_TE.detach()
    if use_kernel and _OPS and select_TE.is_cuda and select_TE.dtype == torch.float32:
        return torch.ops.moe_ladder.router_topk(select_TE.contiguous(), k)
    return torch.topk(select_TE, k, dim=-1).indices
