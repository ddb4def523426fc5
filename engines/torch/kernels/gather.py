"""Gather-and-sum over a step's expert assignments, as Triton kernels (the GPU fast path's default).

Dropless dispatch sorts the T*K assignments by expert. Two passes read them back in token order and
sum each token's K rows:
- the combine: y_TL[t] = sum_k gate_TK[t, k] * y_AL[inv_A[t*K + k]] (fp32 result), whose backward
  is a row gather for y_AL and a gather-and-dot for the gates;
- the dispatch's backward: g_TL[t] = sum_k g_AL[inv_A[t*K + k]].
Inductor fuses each into a gather + reduction kernel that ran at about 1 TB/s on an H200 (0.37 and
0.32 ms a layer at the bench shape). Here one Triton program reads one token's K rows (BLOCK_L
columns at a time) and writes their sum; the gate gradient reads the token's output gradient once
and its K rows. Rows are read whole and contiguous, each exactly once.
The combine's gradient for the sorted rows, g_AL[a] = gate[order_A[a]] * g_TL[order_A[a] // K],
is a gather-and-scale (fast.FastOptions.combine_grad, the default where Triton is installed;
with "inductor", Inductor fuses it into the kernel that sums the residual's gradient).

Where Triton or a GPU is missing, the same functions run as index_select + sum in torch (the
engine's CPU path and its tests). fast.FastOptions.gather = "triton" (the default where Triton is
installed) selects the kernels on a GPU: +3.0% tokens/s on an H200 at the bench shape, 2.9 ms a
step against Inductor's 8.3 ms (bench variant `torch_inductorgather` keeps Inductor's fusion).

Shape legend: A assignments (T*K, sorted by expert), T tokens, K slots per token, L row width.
"""

from __future__ import annotations

import torch

from engines.torch.kernels.ops import register_triton_ops, tl, triton

MAX_L = 8192  # the gate-gradient kernel holds a whole row per program


if triton is not None:

    @triton.jit
    def gather_sum_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, L, K: tl.constexpr, HAS_W: tl.constexpr,
                          BLOCK_L: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        mask = cols < L
        acc = tl.zeros([BLOCK_L], dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(idx_ptr + t * K + k).to(tl.int64)
            x = tl.load(src_ptr + row * L + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                x = x * tl.load(w_ptr + t * K + k).to(tl.float32)
            acc += x
        tl.store(out_ptr + t * L + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gather_dot_kernel(src_ptr, idx_ptr, g_ptr, out_ptr, L, K: tl.constexpr, BLOCK_L: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_L)
        mask = cols < L
        g = tl.load(g_ptr + t * L + cols, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            row = tl.load(idx_ptr + t * K + k).to(tl.int64)
            x = tl.load(src_ptr + row * L + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * K + k, tl.sum(g * x, axis=0))

    @triton.jit
    def gather_scale_kernel(src_ptr, order_ptr, gate_ptr, out_ptr, A, L, K: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_L: tl.constexpr):
        """out[a] = gate[order[a]] * src[order[a] // K] for ROWS sorted rows a per program."""
        a_R = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        a_ok = a_R < A
        mask = a_ok[:, None] & (cols < L)[None, :]
        slot_R = tl.load(order_ptr + a_R, mask=a_ok, other=0).to(tl.int64)
        w_R = tl.load(gate_ptr + slot_R, mask=a_ok, other=0.0).to(tl.float32)
        x = tl.load(src_ptr + (slot_R // K)[:, None] * L + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + a_R[:, None] * L + cols[None, :], (x * w_R[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask)


def _block(L: int) -> int:
    return min(triton.next_power_of_2(L), 1024)


def launch_gather_sum(src_AL, idx_TK, w_TK, out_TL, wrap=lambda k: k) -> None:
    """out_TL = sum_k w_TK[t, k] * src_AL[idx_TK[t, k]] (w_TK None: weights 1) by the Triton kernel;
    `wrap` is torch.library.wrap_triton inside a traced op, the identity when called directly."""
    T, K = idx_TK.shape
    L = src_AL.shape[1]
    B = _block(L)
    w = w_TK if w_TK is not None else idx_TK  # a pointer the kernel never reads
    wrap(gather_sum_kernel)[(T, triton.cdiv(L, B))](src_AL, idx_TK, w, out_TL, L, K=K, HAS_W=w_TK is not None,
                                                    BLOCK_L=B)


def launch_gather_dot(src_AL, idx_TK, g_TL, out_TK, wrap=lambda k: k) -> None:
    """out_TK[t, k] = <g_TL[t], src_AL[idx_TK[t, k]]> (fp32) by the Triton kernel."""
    T, K = idx_TK.shape
    L = src_AL.shape[1]
    wrap(gather_dot_kernel)[(T,)](src_AL, idx_TK, g_TL, out_TK, L, K=K, BLOCK_L=triton.next_power_of_2(L))


def launch_gather_scale(src_TL, order_A, gate_TK, out_AL, wrap=lambda k: k) -> None:
    """out_AL[a] = gate_TK.flat[order_A[a]] * src_TL[order_A[a] // K], rounded to out_AL's dtype."""
    A, L = out_AL.shape
    K = gate_TK.shape[1]
    B, rows = _block(L), 4
    wrap(gather_scale_kernel)[(triton.cdiv(A, rows), triton.cdiv(L, B))](src_TL, order_A, gate_TK, out_AL, A, L,
                                                                          K=K, ROWS=rows, BLOCK_L=B)


# ---- the torch forms (CPU, and the reference the kernels are tested against) ---------------------


def gather_sum_torch(src_AL, idx_TK, w_TK, out_dtype: torch.dtype) -> torch.Tensor:
    T, K = idx_TK.shape
    x_TKL = src_AL.index_select(0, idx_TK.reshape(-1)).view(T, K, -1).float()
    if w_TK is not None:
        x_TKL = x_TKL * w_TK.float().unsqueeze(-1)
    return x_TKL.sum(1).to(out_dtype)


def gather_dot_torch(src_AL, idx_TK, g_TL) -> torch.Tensor:
    T, K = idx_TK.shape
    x_TKL = src_AL.index_select(0, idx_TK.reshape(-1)).view(T, K, -1).float()
    return (x_TKL * g_TL.float().unsqueeze(1)).sum(-1)


def gather_scale_torch(src_TL, order_A, gate_TK, out_dtype: torch.dtype) -> torch.Tensor:
    K = gate_TK.shape[1]
    w_A = gate_TK.reshape(-1).index_select(0, order_A).unsqueeze(-1)
    return (src_TL.index_select(0, order_A // K) * w_A).to(out_dtype)


# ---- ops the compiler can trace ------------------------------------------------------------------

_OPS = False  # the ops below registered (a torch without triton_op leaves the torch forms)
if triton is not None:

    def _gather_sum_op(src_AL: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
        out_TL = src_AL.new_empty((idx_TK.shape[0], src_AL.shape[1]), dtype=out_dtype)
        launch_gather_sum(src_AL, idx_TK, w_TK, out_TL, torch.library.wrap_triton)
        return out_TL

    def _gather_dot_op(src_AL: torch.Tensor, idx_TK: torch.Tensor, g_TL: torch.Tensor) -> torch.Tensor:
        out_TK = src_AL.new_empty(idx_TK.shape, dtype=torch.float32)
        launch_gather_dot(src_AL, idx_TK, g_TL, out_TK, torch.library.wrap_triton)
        return out_TK

    def _gather_scale_op(src_TL: torch.Tensor, order_A: torch.Tensor, gate_TK: torch.Tensor,
                         out_dtype: torch.dtype) -> torch.Tensor:
        out_AL = src_TL.new_empty((order_A.shape[0], src_TL.shape[1]), dtype=out_dtype)
        launch_gather_scale(src_TL, order_A, gate_TK, out_AL, torch.library.wrap_triton)
        return out_AL

    _OPS = register_triton_ops("engines/torch/kernels/gather.py", "the torch forms run",
                               {"moe_ladder::gather_sum": _gather_sum_op,
                                "moe_ladder::gather_dot": _gather_dot_op,
                                "moe_ladder::gather_scale": _gather_scale_op})


def kernels_usable(x: torch.Tensor) -> bool:
    return _OPS and x.is_cuda and x.shape[-1] <= MAX_L


def gather_sum(src_AL, idx_TK, w_TK, out_dtype: torch.dtype, use_kernels: bool = True) -> torch.Tensor:
    """sum_k w_TK[t, k] * src_AL[idx_TK[t, k]] per token, accumulated in fp32, in out_dtype."""
    if use_kernels and kernels_usable(src_AL):
        return torch.ops.moe_ladder.gather_sum(src_AL.contiguous(), idx_TK.contiguous(),
                                               None if w_TK is None else w_TK.contiguous(), out_dtype)
    return gather_sum_torch(src_AL, idx_TK, w_TK, out_dtype)


def gather_scale(src_TL, order_A, gate_TK, out_dtype: torch.dtype, use_kernels: bool = True) -> torch.Tensor:
    """Row a of the result: gate_TK.flat[order_A[a]] * src_TL[order_A[a] // K], computed in fp32,
    in out_dtype (the combine's backward for the sorted rows)."""
    if use_kernels and kernels_usable(src_TL):
        return torch.ops.moe_ladder.gather_scale(src_TL.contiguous(), order_A.contiguous(), gate_TK.contiguous(),
                                                 out_dtype)
    return gather_scale_torch(src_TL, order_A, gate_TK, out_dtype)


def gather_dot(src_AL, idx_TK, g_TL, use_kernels: bool = True) -> torch.Tensor:
    """<g_TL[t], src_AL[idx_TK[t, k]]> per (token, slot), fp32."""
    if use_kernels and kernels_usable(src_AL):
        return torch.ops.moe_ladder.gather_dot(src_AL.contiguous(), idx_TK.contiguous(), g_TL.contiguous())
    return gather_dot_torch(src_AL, idx_TK, g_TL)


class Combine(torch.autograd.Function):
    """y_TL (fp32) = sum_k gate_TK[t, k] * y_AL[inv_A[t*K + k]]; order_A is inv_A's inverse (the
    assignment, token-major, of each sorted row). Backward: the rows' gradient is a gather of the
    output gradient by order_A times the row's gate; the gates' a gather-and-dot."""

    @staticmethod
    def forward(ctx, y_AL, gate_TK, inv_A, order_A, use_kernels: bool, scale_kernel: bool = False):
        T, K = gate_TK.shape
        idx_TK = inv_A.view(T, K)
        ctx.save_for_backward(y_AL, gate_TK, idx_TK, order_A)
        ctx.use_kernels, ctx.scale_kernel = use_kernels, scale_kernel
        return gather_sum(y_AL, idx_TK, gate_TK, torch.float32, use_kernels)

    @staticmethod
    def backward(ctx, g_TL):
        y_AL, gate_TK, idx_TK, order_A = ctx.saved_tensors
        g_rows = gather_scale(g_TL, order_A, gate_TK, y_AL.dtype, ctx.use_kernels and ctx.scale_kernel)
        g_gate = gather_dot(y_AL, idx_TK, g_TL, ctx.use_kernels).to(gate_TK.dtype)
        return g_rows, g_gate, None, None, None, None
