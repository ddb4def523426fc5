"""The experts' SwiGLU with its elementwise work inside the grouped matmuls, as Triton kernels.

Unfused, a layer's experts run gate|up as one grouped matmul (writing gu_A2F), then a kernel
that reads gu_A2F and writes h_AF = silu(gate) * up, then the down matmul; the backward runs the
down matmul's input gradient (writing dh_AF), then a kernel that reads dh_AF and gu_A2F and writes
dgu_A2F. Here:
- `swiglu_up_kernel` computes a row tile's gate and up columns side by side (two accumulators)
  and writes gu_A2F (saved for the backward) and h_AF from registers;
- `swiglu_down_dx_kernel` computes a row tile of dh = dy_AL @ w_down[e]^T and, in its epilogue,
  reads that tile's gate and up and writes dgu_A2F: dh never goes to memory;
- `grouped_mm_kernel` is the same tiling without an epilogue (timed against _grouped_mm by
  bench/kernels_h200.py --only swiglu; not used by the engine).
Both round as the unfused path does (the matmul's output to bf16 first, the SwiGLU in fp32 from
there, its result to the storage dtype). The down matmul's forward and the input gradient of
gate|up stay torch._grouped_mm; the weight gradients are engines/torch/kernels/grouped_dw.py's.

Rows are sorted by expert (offs_E: cumulative row counts, as _grouped_mm's). Each program owns one
[BLOCK_M, BLOCK_N] output tile of one expert: row tiles are numbered expert after expert (an
expert with n rows has cdiv(n, BLOCK_M) of them, counted on the device), and a program finds its
expert by counting the experts whose tiles end at or before its own. The grid is sized for the
worst case (cdiv(A, BLOCK_M) + E row tiles); programs past the last tile store nothing.

Shape legend: A rows (assignments, sorted by expert), E experts, L model width (the up matmul's
input, the down matmul's output), F expert hidden; gu_A2F holds gate | up side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from engines.torch.kernels import gather, grouped_dw
from engines.torch.kernels.ops import register_triton_ops, tl, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N counts hidden columns (the up
# kernel holds BLOCK_N gate and BLOCK_N up columns)
UP_CONFIG = (128, 128, 64, 8, 3)
DOWN_DX_CONFIG = (128, 128, 64, 8, 3)

if triton is not None:

    @triton.jit
    def _tile(N, tile_end_ptr, offs_ptr, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(expert, rows (int64), row mask, columns, column mask) of this program's output tile:
        row tile pm of the experts' row tiles, column tile pn of N."""
        tiles_n = tl.cdiv(N, BLOCK_N)
        pm = tl.program_id(0) // tiles_n
        pn = tl.program_id(0) % tiles_n
        es = tl.arange(0, E_P2)
        ends = tl.load(tile_end_ptr + es, mask=es < E, other=2147483647)
        e = tl.sum((ends <= pm).to(tl.int32), axis=0)
        n_tiles = tl.load(tile_end_ptr + E - 1)  # past it (e == E): no rows
        e = tl.minimum(e, E - 1)
        stop = tl.load(offs_ptr + e)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        first = tl.load(tile_end_ptr + e) - tl.cdiv(stop - start, BLOCK_M)
        rows = start + (pm - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_ok = (rows < stop) & (pm + tl.zeros([BLOCK_M], dtype=tl.int32) < n_tiles)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        return e, rows.to(tl.int64), r_ok, cols, cols < N

    @triton.jit
    def _tile_matmul(x_ptr, rows, r_ok, w_e, s_wk, s_wn, cols, c_ok, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N] = x[rows, :K] @ w_e[:K, cols], w_e read through its strides."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_e + kk[:, None] * s_wk + cols[None, :] * s_wn, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def swiglu_up_kernel(tile_end_ptr, offs_ptr, x_ptr, idx_ptr, w_ptr, gu_ptr, h_ptr, L, Fh, E,
                         HAS_IDX: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e, rows, r_ok, cols, c_ok = _tile(Fh, tile_end_ptr, offs_ptr, E, E_P2, BLOCK_M, BLOCK_N)
        if HAS_IDX:  # the dispatch's gather: row r of the product is x row idx[r]
            x_rows = tl.load(idx_ptr + rows, mask=r_ok, other=0).to(tl.int64)
        else:
            x_rows = rows
        ks = tl.arange(0, BLOCK_K)
        w_e = w_ptr + e.to(tl.int64) * L * 2 * Fh  # w_gu[e]: [L, 2F], gate | up
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):  # one row tile read once for both accumulators
            kk = k0 + ks
            k_ok = kk < L
            a = tl.load(x_ptr + x_rows[:, None] * L + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & c_ok[None, :]
            bg = tl.load(w_e + kk[:, None] * (2 * Fh) + cols[None, :], mask=b_mask, other=0.0)
            bu = tl.load(w_e + kk[:, None] * (2 * Fh) + Fh + cols[None, :], mask=b_mask, other=0.0)
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        g = acc_g.to(gu_ptr.dtype.element_ty)
        u = acc_u.to(gu_ptr.dtype.element_ty)
        mask = r_ok[:, None] & c_ok[None, :]
        out = gu_ptr + rows[:, None] * (2 * Fh) + cols[None, :]
        tl.store(out, g, mask=mask)
        tl.store(out + Fh, u, mask=mask)
        gf = g.to(tl.float32)
        h = gf * tl.sigmoid(gf) * u.to(tl.float32)
        tl.store(h_ptr + rows[:, None] * Fh + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_down_dx_kernel(tile_end_ptr, offs_ptr, dy_ptr, w_ptr, gu_ptr, dgu_ptr, L, Fh, E,
                              E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        e, rows, r_ok, cols, c_ok = _tile(Fh, tile_end_ptr, offs_ptr, E, E_P2, BLOCK_M, BLOCK_N)
        # w_down[e]: [F, L]; the matmul reads its transpose
        acc = _tile_matmul(dy_ptr, rows, r_ok, w_ptr + e.to(tl.int64) * Fh * L, 1, L, cols, c_ok, L,
                           BLOCK_M, BLOCK_N, BLOCK_K)
        mask = r_ok[:, None] & c_ok[None, :]
        dh = acc.to(dgu_ptr.dtype.element_ty).to(tl.float32)
        src = gu_ptr + rows[:, None] * (2 * Fh) + cols[None, :]
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + Fh, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))
        du = dh * (g * sig)
        out = dgu_ptr + rows[:, None] * (2 * Fh) + cols[None, :]
        tl.store(out, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(out + Fh, du.to(dgu_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def grouped_mm_kernel(tile_end_ptr, offs_ptr, x_ptr, w_ptr, y_ptr, K, N, E, s_we, s_wk, s_wn,
                          E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        """y_AN = x_AK @ w[e] per expert's rows, w[e] read through strides (a transposed view for
        an input gradient): the same tiling as the SwiGLU kernels, without an epilogue."""
        e, rows, r_ok, cols, c_ok = _tile(N, tile_end_ptr, offs_ptr, E, E_P2, BLOCK_M, BLOCK_N)
        acc = _tile_matmul(x_ptr, rows, r_ok, w_ptr + e.to(tl.int64) * s_we, s_wk, s_wn, cols, c_ok, K,
                           BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & c_ok[None, :])


def _launch(kernel, offs_E, A: int, N: int, config, wrap, *args, **meta) -> None:
    """kernel[grid](tile ends, offs_E, *args) over the worst-case row tiles (cdiv(A, BLOCK_M) + E)
    times N's column tiles; the row tiles' cumulative counts per expert are counted on the device."""
    bm, bn, bk, warps, stages = config
    counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    tile_end_E = torch.cumsum((counts_E + bm - 1) // bm, 0, dtype=torch.int32)
    E = offs_E.shape[0]
    grid = ((triton.cdiv(A, bm) + E) * triton.cdiv(N, bn),)
    wrap(kernel)[grid](tile_end_E, offs_E, *args, E_P2=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn,
                       BLOCK_K=bk, num_warps=warps, num_stages=stages, **meta)


def _check(name: str, **tensors: torch.Tensor) -> None:
    for key, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: {key} must be contiguous (strides {t.stride()})")


def launch_swiglu_up(x_AL, w_gu, offs_E, gu_A2F, h_AF, config=UP_CONFIG, wrap=lambda k: k,
                     idx_A=None) -> None:
    """gu_A2F = x_AL @ w_gu[e] per expert's rows, h_AF = silu(gate) * up, written in place. With
    idx_A, x_AL is read as x[idx_A] (x: the tokens' rows; the dispatch's gather is the kernel's)."""
    _check("swiglu_up", x=x_AL, w_gu=w_gu, gu=gu_A2F, h=h_AF)
    A, L = gu_A2F.shape[0], x_AL.shape[1]
    E, Fh = w_gu.shape[0], w_gu.shape[2] // 2
    idx = idx_A if idx_A is not None else offs_E  # a pointer the kernel never reads
    _launch(swiglu_up_kernel, offs_E, A, Fh, config, wrap, x_AL, idx, w_gu, gu_A2F, h_AF, L, Fh, E,
            HAS_IDX=idx_A is not None)


def launch_swiglu_down_dx(dy_AL, w_down, gu_A2F, offs_E, dgu_A2F, config=DOWN_DX_CONFIG,
                          wrap=lambda k: k) -> None:
    """dgu_A2F = the gradient of gate | up, from dh = dy_AL @ w_down[e]^T per expert's rows."""
    _check("swiglu_down_dx", dy=dy_AL, w_down=w_down, gu=gu_A2F, dgu=dgu_A2F)
    A, L = dy_AL.shape
    E, Fh = w_down.shape[0], w_down.shape[1]
    _launch(swiglu_down_dx_kernel, offs_E, A, Fh, config, wrap, dy_AL, w_down, gu_A2F, dgu_A2F, L, Fh, E)


def launch_grouped_mm(x_AK, w_EKN, offs_E, y_AN, config=UP_CONFIG, wrap=lambda k: k) -> None:
    """y_AN = x_AK @ w_EKN[e] per expert's rows (w_EKN any strides, e.g. a transposed view)."""
    _check("grouped_mm", x=x_AK, y=y_AN)
    A, K = x_AK.shape
    E, N = w_EKN.shape[0], w_EKN.shape[2]
    _launch(grouped_mm_kernel, offs_E, A, N, config, wrap, x_AK, w_EKN, y_AN, K, N, E, *w_EKN.stride())


# ---- the torch forms (the reference of the tests) -------------------------------------------------


def swiglu_up_torch(x_AL, w_gu, offs_E, idx_A=None):
    """(gu_A2F, h_AF) by a loop over experts, rounded as the kernels round."""
    if idx_A is not None:
        x_AL = x_AL.index_select(0, idx_A)
    Fh, acc = w_gu.shape[2] // 2, torch.promote_types(x_AL.dtype, torch.float32)
    gu, start = [], 0
    for e, stop in enumerate(offs_E.tolist()):
        gu.append((x_AL[start:stop].to(acc) @ w_gu[e].to(acc)).to(x_AL.dtype))
        start = stop
    gu_A2F = torch.cat(gu)
    g, u = gu_A2F[:, :Fh].to(acc), gu_A2F[:, Fh:].to(acc)
    return gu_A2F, (F_.silu(g) * u).to(x_AL.dtype)


def swiglu_down_dx_torch(dy_AL, w_down, gu_A2F, offs_E):
    """dgu_A2F by a loop over experts, rounded as the kernel rounds."""
    Fh, acc = w_down.shape[1], torch.promote_types(dy_AL.dtype, torch.float32)
    dh, start = [], 0
    for e, stop in enumerate(offs_E.tolist()):
        dh.append((dy_AL[start:stop].to(acc) @ w_down[e].to(acc).T).to(dy_AL.dtype))
        start = stop
    dh = torch.cat(dh).to(acc)
    g, u = gu_A2F[:, :Fh].to(acc), gu_A2F[:, Fh:].to(acc)
    sig = torch.sigmoid(g)
    return torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], -1).to(dy_AL.dtype)


# ---- ops the compiler can trace, and the experts' function that uses them ------------------------

_OPS = False
if triton is not None:

    def _swiglu_up_op(x_AL: torch.Tensor, w_gu: torch.Tensor, offs_E: torch.Tensor,
                      idx_A: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        A, Fh = (x_AL if idx_A is None else idx_A).shape[0], w_gu.shape[2] // 2
        gu_A2F = x_AL.new_empty((A, 2 * Fh))
        h_AF = x_AL.new_empty((A, Fh))
        launch_swiglu_up(x_AL, w_gu, offs_E, gu_A2F, h_AF, wrap=torch.library.wrap_triton, idx_A=idx_A)
        return gu_A2F, h_AF

    def _swiglu_down_dx_op(dy_AL: torch.Tensor, w_down: torch.Tensor, gu_A2F: torch.Tensor,
                           offs_E: torch.Tensor) -> torch.Tensor:
        dgu_A2F = torch.empty_like(gu_A2F)
        launch_swiglu_down_dx(dy_AL, w_down, gu_A2F, offs_E, dgu_A2F, wrap=torch.library.wrap_triton)
        return dgu_A2F

    _OPS = register_triton_ops("engines/torch/kernels/swiglu_gemm.py", "the unfused experts run",
                               {"moe_ladder::swiglu_up": _swiglu_up_op,
                                "moe_ladder::swiglu_down_dx": _swiglu_down_dx_op})


def kernels_usable(x: torch.Tensor) -> bool:
    """Every op FusedExperts calls runs on x's device (a GPU with Triton)."""
    return _OPS and grouped_dw.kernel_usable(x) and gather.kernels_usable(x)


class FusedExperts(torch.autograd.Function):
    """y_AL = (silu(x w_gate) * (x w_up)) w_down per expert's rows, with the SwiGLU inside the
    up matmul's epilogue (forward) and the down matmul's input-gradient epilogue (backward).

    x is x_AL (rows sorted by expert), or, with src_A, the tokens' rows x_TL read as x_TL[src_A]
    by the up matmul and the weight gradient (the dispatch's gather inside them: x_AL is never
    written); then the input gradient is summed back to the tokens by gather.py's gather-and-sum
    over inv_A (src_A's inverse, token-major, K slots a token)."""

    @staticmethod
    def forward(ctx, x, w_gu, w_down, offs_E, src_A, inv_A, K: int):
        gu_A2F, h_AF = torch.ops.moe_ladder.swiglu_up(x, w_gu, offs_E, src_A)
        ctx.gathered, ctx.K = src_A is not None, K
        ctx.save_for_backward(x, w_gu, w_down, offs_E, gu_A2F, h_AF, *((src_A, inv_A) if ctx.gathered else ()))
        return torch._grouped_mm(h_AF, w_down, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_AL):
        x, w_gu, w_down, offs_E, gu_A2F, h_AF, *index = ctx.saved_tensors
        src_A, inv_A = index if ctx.gathered else (None, None)
        dy_AL = dy_AL.contiguous()
        dgu_A2F = torch.ops.moe_ladder.swiglu_down_dx(dy_AL, w_down, gu_A2F, offs_E)
        dw_down = torch.ops.moe_ladder.grouped_dw(h_AF, dy_AL, offs_E, w_down.dtype)
        dx = torch._grouped_mm(dgu_A2F, w_gu.transpose(-2, -1), offs=offs_E)
        dw_gu = torch.ops.moe_ladder.grouped_dw(x, dgu_A2F, offs_E, w_gu.dtype, src_A)
        if src_A is not None:
            dx = torch.ops.moe_ladder.gather_sum(dx, inv_A.view(-1, ctx.K), None, dx.dtype)
        return dx, dw_gu, dw_down, None, None, None, None


def fused_experts(x_AL, w_gu, w_down, offs_E) -> torch.Tensor:
    """The experts' SwiGLU over rows sorted by expert, through FusedExperts."""
    return FusedExperts.apply(x_AL.contiguous(), w_gu.contiguous(), w_down.contiguous(), offs_E, None, None, 1)


def fused_dispatch_experts(x_TL, src_A, inv_A, K: int, w_gu, w_down, offs_E) -> torch.Tensor:
    """The same from the tokens' rows: x_TL[src_A] sorted by expert is never materialised."""
    return FusedExperts.apply(x_TL.contiguous(), w_gu.contiguous(), w_down.contiguous(), offs_E,
                              src_A.contiguous(), inv_A.contiguous(), K)
