"""MasterAdamW's update of one tensor as one Triton kernel: reads master, gradient, moments and the
step's constants, writes master, moments and the tensor's slice of its working copy. Moments are
fp32 or bf16 (read into fp32, rounded to nearest on the store).

Compiled by Inductor (master.adamw_group_), the update of the blocks' concatenated working copies
(q|k|v, gate|up) took a second pass: Inductor wrote each leaf's slices in separate kernels that
read the new masters again (3.7 of 13.5 optimizer ms a step on an H200 at the bench shape), and
compiling the groups' graphs added up to a minute of warm-up. Here each parameter is one launch
that touches every byte once (28 bytes a parameter with a bf16 copy), with nothing to compile
but this kernel.

The arithmetic is master.adamw_'s (torch.optim.AdamW's update, with the clip multiplier and the
step's finite flag from s_9), with IEEE-rounded division and square root as torch computes them.

Shape legend: N elements of the master (contiguous), viewed as R rows of C (its last dimension);
the gradient and the working copy are [R, C] views with row strides of their own (a slice of a
wider leaf's last dimension).
"""

from __future__ import annotations

import os

import torch

from engines.torch.kernels.ops import tl, triton

# elements a program by moment dtype: on an H200 the fp32-moment kernel took 0.462 ms at 2,048
# against 0.517 at 1,024 (66M parameters; bench/kernels_h200.py --only optimizer), bf16 moments
# 0.327 at 1,024 against 0.341 at 2,048
BLOCK = {torch.float32: 2048, torch.bfloat16: 1024}
MOMENT_DTYPES = (torch.float32, torch.bfloat16)

if triton is not None:

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, s_ptr, N, C, g_row, w_row,
                     HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        row = offs // C
        col = offs - row * C
        step_size = tl.load(s_ptr + 0)
        decay = tl.load(s_ptr + 1)
        one_minus_b1 = tl.load(s_ptr + 2)
        b2 = tl.load(s_ptr + 3)
        one_minus_b2 = tl.load(s_ptr + 4)
        eps = tl.load(s_ptr + 5)
        inv_bc2 = tl.load(s_ptr + 6)
        clip = tl.load(s_ptr + 7)
        ok = tl.load(s_ptr + 8) > 0
        g = tl.load(g_ptr + row * g_row + col, mask=mask, other=0.0).to(tl.float32) * clip
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m_new = m + one_minus_b1 * (g - m)  # torch.lerp's form for weights below 0.5
        v_new = v * b2 + g * g * one_minus_b2
        denom = tl.sqrt_rn(v_new) * inv_bc2 + eps
        p_new = p * decay - tl.div_rn(m_new, denom) * step_size
        p_new = tl.where(ok, p_new, p)
        tl.store(p_ptr + offs, p_new, mask=mask)
        tl.store(m_ptr + offs, tl.where(ok, m_new, m).to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, tl.where(ok, v_new, v).to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(w_ptr + row * w_row + col, p_new.to(w_ptr.dtype.element_ty), mask=mask)


def kernel_usable(t: torch.Tensor) -> bool:
    """Triton is installed and can run on t's device (a GPU, or its interpreter on the CPU)."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _row_stride(t: torch.Tensor, C: int) -> int:
    """The stride between t's rows of C, if t's leading dimensions flatten into evenly strided rows
    of unit-stride columns (a contiguous tensor, or a slice of a contiguous one's last dim)."""
    if t.dim() < 2:
        if t.stride(-1) != 1:
            raise ValueError("adamw_kernel: a 1-d tensor must be contiguous")
        return C
    if t.stride(-1) != 1:
        raise ValueError(f"adamw_kernel: columns must be contiguous (strides {t.stride()})")
    row = want = t.stride(-2)
    for d in range(t.dim() - 2, 0, -1):  # dimension d - 1 must step over all of dimension d
        want *= t.shape[d]
        if t.shape[d - 1] != 1 and t.stride(d - 1) != want:  # (a size-1 dim's stride is never used)
            raise ValueError(f"adamw_kernel: rows are not evenly strided (shape {tuple(t.shape)}, "
                             f"strides {t.stride()})")
    return row


def adamw_launch(p_N, g_N, m_N, v_N, w_N, s_9, block: int | None = None, num_warps: int = 4) -> None:
    """master.adamw_(p_N, g_N, m_N, v_N, w_N, s_9) by one kernel launch (w_N may be None); block
    elements a program (bench/kernels_h200.py --only optimizer times the choices)."""
    if not (p_N.is_contiguous() and m_N.is_contiguous() and v_N.is_contiguous()):
        raise ValueError("adamw_kernel: master and moments must be contiguous")
    if p_N.dtype != torch.float32 or s_9.dtype != torch.float32:
        raise ValueError("adamw_kernel: fp32 masters and constants only")
    if m_N.dtype not in MOMENT_DTYPES or v_N.dtype not in MOMENT_DTYPES:
        raise ValueError(f"adamw_kernel: moments in fp32 or bf16 (got {m_N.dtype}, {v_N.dtype})")
    N = p_N.numel()
    if N == 0:
        return
    block = block or BLOCK[m_N.dtype]
    C = p_N.shape[-1] if p_N.dim() else 1
    g_row = _row_stride(g_N, C)
    w_row = _row_stride(w_N, C) if w_N is not None else C
    adamw_kernel[(triton.cdiv(N, block),)](p_N, g_N, m_N, v_N, w_N if w_N is not None else p_N, s_9, N, C,
                                            g_row, w_row, HAS_W=w_N is not None, BLOCK=block, num_warps=num_warps)
