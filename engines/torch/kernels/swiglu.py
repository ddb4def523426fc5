"""The experts' SwiGLU between the two grouped matmuls, h = silu(gate) * up, with its backward as
one Triton kernel (fast.FastOptions.swiglu = "triton").

Inductor's fused backward (silu_backward over the [A, 2F] gate|up and two slice_backwards added)
ran at about 2.4 TB/s on an H200 at the bench shape: 3.4 ms a step, where the forward's kernel,
which moves 2/3 of the bytes, took 1.1. Here each program owns a [BLOCK_R, BLOCK_F] tile of rows
and writes both halves of the gradient from one read of gate, up and dh. The forward stays torch
(Inductor's kernel is at bandwidth already).

The arithmetic is fp32 from 16-bit inputs, as Inductor's: with s = sigmoid(g),
d gate = dh * up * s * (1 + g * (1 - s)), d up = dh * g * s.

Shape legend: A rows (expert assignments), F expert hidden width; gate|up is [A, 2F], gate first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.torch.kernels.ops import register_triton_ops, tl, triton

BLOCK_R = 8

if triton is not None:

    @triton.jit
    def swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, A, Fh, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        ok = (rows < A)[:, None] & (cols < Fh)[None, :]
        gate_at = rows[:, None] * (2 * Fh) + cols[None, :]
        g = tl.load(gu_ptr + gate_at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + gate_at + Fh, mask=ok, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + rows[:, None] * Fh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        d_gate = dh * u * s * (1.0 + g * (1.0 - s))
        d_up = dh * g * s
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_ptr + gate_at, d_gate.to(out_ty), mask=ok)
        tl.store(dgu_ptr + gate_at + Fh, d_up.to(out_ty), mask=ok)


def launch_swiglu_bwd(gu_A2F: torch.Tensor, dh_AF: torch.Tensor, dgu_A2F: torch.Tensor, wrap=lambda k: k) -> None:
    """dgu_A2F = the gradient of silu(gate) * up at gu_A2F for dh_AF, by the kernel (all contiguous)."""
    A, Fh = dh_AF.shape
    if gu_A2F.shape != (A, 2 * Fh) or dgu_A2F.shape != gu_A2F.shape:
        raise ValueError(f"swiglu_bwd: gate|up {tuple(gu_A2F.shape)}, dh {tuple(dh_AF.shape)}, "
                         f"out {tuple(dgu_A2F.shape)} (want [A, 2F], [A, F], [A, 2F])")
    if A == 0:
        return
    block_f = min(triton.next_power_of_2(Fh), 1024)
    wrap(swiglu_bwd_kernel)[(triton.cdiv(A, BLOCK_R), triton.cdiv(Fh, block_f))](
        gu_A2F, dh_AF, dgu_A2F, A, Fh, BLOCK_R=BLOCK_R, BLOCK_F=block_f)


def swiglu_bwd_torch(gu_A2F: torch.Tensor, dh_AF: torch.Tensor) -> torch.Tensor:
    """The same gradient in torch (fp32 arithmetic, the inputs' dtype out)."""
    Fh = dh_AF.shape[1]
    g, u, dh = gu_A2F[:, :Fh].float(), gu_A2F[:, Fh:].float(), dh_AF.float()
    s = torch.sigmoid(g)
    return torch.cat([dh * u * s * (1 + g * (1 - s)), dh * g * s], 1).to(gu_A2F.dtype)


_OPS = False
if triton is not None:

    def _swiglu_bwd_op(gu_A2F: torch.Tensor, dh_AF: torch.Tensor) -> torch.Tensor:
        dgu_A2F = torch.empty_like(gu_A2F)
        launch_swiglu_bwd(gu_A2F, dh_AF, dgu_A2F, wrap=torch.library.wrap_triton)
        return dgu_A2F

    _OPS = register_triton_ops("engines/torch/kernels/swiglu.py", "Inductor's backward runs",
                               {"moe_ladder::swiglu_bwd": _swiglu_bwd_op})


def kernel_usable(x: torch.Tensor) -> bool:
    return _OPS and x.is_cuda


class SwiGLU(torch.autograd.Function):
    """h_AF = silu(gate) * up of gu_A2F; the backward is swiglu_bwd_kernel."""

    @staticmethod
    def forward(ctx, gu_A2F):
        ctx.save_for_backward(gu_A2F)
        Fh = gu_A2F.shape[1] // 2
        return F.silu(gu_A2F[:, :Fh]) * gu_A2F[:, Fh:]

    @staticmethod
    def backward(ctx, dh_AF):
        (gu_A2F,) = ctx.saved_tensors
        return torch.ops.moe_ladder.swiglu_bwd(gu_A2F.contiguous(), dh_AF.contiguous())


def swiglu(gu_A2F: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """silu(gate) * up over gu_A2F's two halves, with the Triton backward where it runs."""
    if use_kernel and kernel_usable(gu_A2F):
        return SwiGLU.apply(gu_A2F)
    Fh = gu_A2F.shape[1] // 2
    return F.silu(gu_A2F[:, :Fh]) * gu_A2F[:, Fh:]
