"""The output head's two losses from 16-bit logits as two Triton kernels (TorchKernels.xent =
"triton"; engines/torch/loss.head_losses with kernel=True calls them): mean cross-entropy and mean
squared log-partition (the z-loss term).

Inductor computes them in a logsumexp reduction over the [T, V] logits and, in the backward, one
pointwise kernel for their gradient: 0.88 and 1.48 ms a step on an H200 at the bench shape (T
16,384, V 50,304), about 2 TB/s. Here one program reads one row: the forward in V-chunks with an
online max and sum (fp32), also picking the target's logit; the backward recomputes each
probability from the saved log-partition and writes the row's gradient once:
d logit = (g_ce (p - onehot) + g_z 2 lse p) / T.

Shape legend: T tokens (rows), V vocabulary.
"""

from __future__ import annotations

import torch

from engines.torch.kernels.ops import register_triton_ops, tl, triton

BLOCK_V = 4096

if triton is not None:

    @triton.jit
    def xent_fwd_kernel(logits_ptr, tgt_ptr, lse_ptr, tgt_logit_ptr, V, stride, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # (a lane that has seen only -inf keeps s = 0: exp(-inf - -inf) would be nan)
            s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.exp(x - m_new))
            m = m_new
        m_row = tl.max(m, axis=0)
        s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), axis=0)
        tl.store(lse_ptr + row, m_row + tl.log(s_row))
        tgt = tl.load(tgt_ptr + row)
        tl.store(tgt_logit_ptr + row, tl.load(base + tgt).to(tl.float32))

    @triton.jit
    def xent_bwd_kernel(logits_ptr, tgt_ptr, lse_ptr, g_ptr, dlogits_ptr, V, stride, inv_T,
                        BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        lse = tl.load(lse_ptr + row)
        tgt = tl.load(tgt_ptr + row)
        g_ce = tl.load(g_ptr) * inv_T
        g_z = tl.load(g_ptr + 1) * inv_T
        coef = g_ce + 2.0 * g_z * lse
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
            d = coef * tl.exp(x - lse) - tl.where(cols == tgt, g_ce, 0.0)
            tl.store(dlogits_ptr + row * stride + cols, d.to(dlogits_ptr.dtype.element_ty), mask=ok)


def launch_xent_fwd(logits_TV, tgt_T, lse_T, tgt_logit_T, wrap=lambda k: k) -> None:
    T, V = logits_TV.shape
    wrap(xent_fwd_kernel)[(T,)](logits_TV, tgt_T, lse_T, tgt_logit_T, V, logits_TV.stride(0),
                                BLOCK_V=BLOCK_V, num_warps=8)


def launch_xent_bwd(logits_TV, tgt_T, lse_T, g_2, dlogits_TV, wrap=lambda k: k) -> None:
    T, V = logits_TV.shape
    wrap(xent_bwd_kernel)[(T,)](logits_TV, tgt_T, lse_T, g_2, dlogits_TV, V, logits_TV.stride(0), 1.0 / T,
                                BLOCK_V=BLOCK_V, num_warps=8)


# ---- the torch forms (CPU, and the reference the kernels are tested against) ---------------------


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def xent_fwd_torch(logits_TV, tgt_T):
    """(lse_T, the target's logit_T), fp32 (fp64 from fp64 logits)."""
    x = _wide(logits_TV)
    return torch.logsumexp(x, -1), x.gather(-1, tgt_T.unsqueeze(-1)).squeeze(-1)


def xent_bwd_torch(logits_TV, tgt_T, lse_T, g_2):
    """The logits' gradient for the losses' gradients g_2 = (d mean ce, d mean lse^2), in their dtype."""
    T = logits_TV.shape[0]
    p = torch.exp(_wide(logits_TV) - lse_T.unsqueeze(-1))
    d = (g_2[0] + 2 * g_2[1] * lse_T.unsqueeze(-1)) * p / T
    d = d - torch.nn.functional.one_hot(tgt_T, logits_TV.shape[1]).to(d.dtype) * (g_2[0] / T)
    return d.to(logits_TV.dtype)


_OPS = False
if triton is not None:

    def _xent_fwd_op(logits_TV: torch.Tensor, tgt_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = logits_TV.shape[0]
        lse_T = logits_TV.new_empty((T,), dtype=torch.float32)
        tgt_logit_T = logits_TV.new_empty((T,), dtype=torch.float32)
        launch_xent_fwd(logits_TV, tgt_T, lse_T, tgt_logit_T, wrap=torch.library.wrap_triton)
        return lse_T, tgt_logit_T

    def _xent_bwd_op(logits_TV: torch.Tensor, tgt_T: torch.Tensor, lse_T: torch.Tensor,
                     g_2: torch.Tensor) -> torch.Tensor:
        dlogits_TV = torch.empty_like(logits_TV)
        launch_xent_bwd(logits_TV, tgt_T, lse_T, g_2, dlogits_TV, wrap=torch.library.wrap_triton)
        return dlogits_TV

    _OPS = register_triton_ops("engines/torch/kernels/xent.py", "Inductor's loss kernels run",
                               {"moe_ladder::xent_fwd": _xent_fwd_op, "moe_ladder::xent_bwd": _xent_bwd_op})


def kernels_usable(x: torch.Tensor) -> bool:
    return _OPS and x.is_cuda


class HeadLosses(torch.autograd.Function):
    """(mean cross-entropy, mean lse^2) of logits_TV (16-bit) against tgt_T, fp32, by the kernels."""

    @staticmethod
    def forward(ctx, logits_TV, tgt_T):
        lse_T, tgt_logit_T = torch.ops.moe_ladder.xent_fwd(logits_TV, tgt_T)
        ctx.save_for_backward(logits_TV, tgt_T, lse_T)
        return (lse_T - tgt_logit_T).mean(), lse_T.square().mean()

    @staticmethod
    def backward(ctx, g_ce, g_z):
        logits_TV, tgt_T, lse_T = ctx.saved_tensors
        g_2 = torch.stack([g_ce, g_z]).float()
        return torch.ops.moe_ladder.xent_bwd(logits_TV, tgt_T, lse_T, g_2), None
