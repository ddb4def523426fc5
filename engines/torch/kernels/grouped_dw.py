"""The weight gradient of a grouped matmul over rows sorted by expert, as one Triton kernel.

For y_AN = x_AK @ w_EKN[e(row)] (torch._grouped_mm with offs_E), the weight gradient is one GEMM
per expert whose contraction runs over that expert's rows: dw_EKN[e] = x_AK[rows e].T @ dy_AN[rows e].
torch._grouped_mm's backward runs it as a grouped GEMM with ragged K, the slowest of its three
roles on an H200 at the bench shape (forward and input gradient are ragged in M): 557 and 503
TFLOP/s for the gate|up and down weights (bench/kernels_h200.py --only grouped).

Here each program owns one [BLOCK_K, BLOCK_N] tile of one expert's gradient and walks that
expert's rows BLOCK_R at a time: both operands are read row-major as stored (the transpose is
the dot's, in shared memory), accumulated in fp32, written once in dw's dtype. An expert without
rows gets a zero gradient. With [128, 256] tiles it ran 672 and 583 TFLOP/s there, and its
result equalled _grouped_mm's exactly (same fp32 accumulation over the same rows in order).

GroupedMM is _grouped_mm with this weight gradient in its backward (the input gradient stays
_grouped_mm's), for the fast path's expert matmuls.

Shape legend: A rows (sorted by expert), E experts, K input width, N output width; R a block of
rows.
"""

from __future__ import annotations

import torch

from engines.torch.kernels.ops import register_triton_ops, tl, triton

# (BLOCK_K, BLOCK_N, BLOCK_R, num_warps, num_stages)
DEFAULT_CONFIG = (128, 256, 64, 8, 3)  # the best of 8 on an H200 for both expert matmuls

if triton is not None:

    @triton.jit
    def grouped_dw_kernel(x_ptr, idx_ptr, dy_ptr, offs_ptr, dw_ptr, K, N, E, HAS_IDX: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        e = tl.program_id(1)
        tiles_n = tl.cdiv(N, BLOCK_N)
        pk = tl.program_id(0) // tiles_n
        pn = tl.program_id(0) % tiles_n
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        stop = tl.load(offs_ptr + e).to(tl.int64)
        ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_R)
        k_ok = ks < K
        n_ok = ns < N
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for r0 in range(start, stop, BLOCK_R):
            rows = r0 + rs
            r_ok = rows < stop
            if HAS_IDX:  # x's rows gathered: row r of the product is x row idx[r]
                x_rows = tl.load(idx_ptr + rows, mask=r_ok, other=0).to(tl.int64)
            else:
                x_rows = rows
            x_RK = tl.load(x_ptr + x_rows[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            dy_RN = tl.load(dy_ptr + rows[:, None] * N + ns[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(tl.trans(x_RK), dy_RN, acc)
        out = dw_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :]
        tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def launch_grouped_dw(x_AK: torch.Tensor, dy_AN: torch.Tensor, offs_E: torch.Tensor, dw_EKN: torch.Tensor,
                      config: tuple[int, int, int, int, int] = DEFAULT_CONFIG, wrap=lambda k: k,
                      idx_A: torch.Tensor | None = None) -> None:
    """dw_EKN[e] = x_AK[offs_E[e-1]:offs_E[e]].T @ dy_AN[same rows], written into dw_EKN.
    x_AK, dy_AN row-major contiguous; offs_E the cumulative row counts (int32, as _grouped_mm's).
    With idx_A, x_AK is read as x[idx_A] (x any number of rows): the gather is the kernel's."""
    K = x_AK.shape[1]
    A = dy_AN.shape[0] if idx_A is not None else x_AK.shape[0]
    E, N = offs_E.shape[0], dy_AN.shape[1]
    if not (x_AK.is_contiguous() and dy_AN.is_contiguous() and dw_EKN.is_contiguous()):
        raise ValueError("grouped_dw: x, dy and dw must be contiguous")
    if dy_AN.shape[0] != A or tuple(dw_EKN.shape) != (E, K, N):
        raise ValueError(f"grouped_dw: shapes x {tuple(x_AK.shape)}, dy {tuple(dy_AN.shape)}, "
                         f"dw {tuple(dw_EKN.shape)} for {E} experts")
    bk, bn, br, warps, stages = config
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), E)
    idx = idx_A if idx_A is not None else offs_E  # a pointer the kernel never reads
    wrap(grouped_dw_kernel)[grid](x_AK, idx, dy_AN, offs_E, dw_EKN, K, N, E, HAS_IDX=idx_A is not None,
                                  BLOCK_K=bk, BLOCK_N=bn, BLOCK_R=br, num_warps=warps, num_stages=stages)


def grouped_dw_torch(x_AK: torch.Tensor, dy_AN: torch.Tensor, offs_E: torch.Tensor,
                     idx_A: torch.Tensor | None = None) -> torch.Tensor:
    """The same gradient by a loop over experts (the reference of the tests), in fp32."""
    if idx_A is not None:
        x_AK = x_AK.index_select(0, idx_A)
    out, start = [], 0
    for stop in offs_E.tolist():
        out.append(x_AK[start:stop].float().T @ dy_AN[start:stop].float())
        start = stop
    return torch.stack(out)


# ---- an op the compiler can trace, and the matmul that uses it --------------------------------------

_OPS = False
if triton is not None:

    def _grouped_dw_op(x_AK: torch.Tensor, dy_AN: torch.Tensor, offs_E: torch.Tensor,
                       dtype: torch.dtype, idx_A: torch.Tensor | None = None) -> torch.Tensor:
        dw_EKN = x_AK.new_empty((offs_E.shape[0], x_AK.shape[1], dy_AN.shape[1]), dtype=dtype)
        launch_grouped_dw(x_AK, dy_AN, offs_E, dw_EKN, wrap=torch.library.wrap_triton, idx_A=idx_A)
        return dw_EKN

    _OPS = register_triton_ops("engines/torch/kernels/grouped_dw.py", "_grouped_mm's backward runs",
                               {"moe_ladder::grouped_dw": _grouped_dw_op})


def kernel_usable(x: torch.Tensor) -> bool:
    return _OPS and x.is_cuda


class GroupedMM(torch.autograd.Function):
    """y_AN = torch._grouped_mm(x_AK, w_EKN, offs=offs_E); backward: dx by _grouped_mm, dw by
    grouped_dw_kernel."""

    @staticmethod
    def forward(ctx, x_AK, w_EKN, offs_E):
        ctx.save_for_backward(x_AK, w_EKN, offs_E)
        return torch._grouped_mm(x_AK, w_EKN, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_AN):
        x_AK, w_EKN, offs_E = ctx.saved_tensors
        dy_AN = dy_AN.contiguous()
        dx_AK = torch._grouped_mm(dy_AN, w_EKN.transpose(-2, -1), offs=offs_E)
        dw_EKN = torch.ops.moe_ladder.grouped_dw(x_AK.contiguous(), dy_AN, offs_E, w_EKN.dtype)
        return dx_AK, dw_EKN, None


def grouped_mm(x_AK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """torch._grouped_mm(x_AK, w_EKN, offs=offs_E), with grouped_dw_kernel for the weight gradient
    where it runs (use_kernel and a GPU with Triton)."""
    if use_kernel and kernel_usable(x_AK):
        return GroupedMM.apply(x_AK, w_EKN, offs_E)
    return torch._grouped_mm(x_AK, w_EKN, offs=offs_E)
