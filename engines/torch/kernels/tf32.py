"""A matmul of fp32 inputs on TF32 tensor cores, without a process-wide switch: the fast path's
router logits.

CUDA runs fp32 matmuls on SIMT cores unless torch.backends.cuda.matmul.allow_tf32 is set, and that
setting reaches every fp32 matmul of the process (the GPU tests' fp32 reference included). The
router's logits matmul is the fast path's only fp32 one: [T, D] x [D, E], 2.3 ms a step of SIMT
kernels on an H200 at the bench shape, where the process-wide switch gave +1.5-1.8% tokens/s.
`mm_tf32` is a custom op whose forward and backward turn TF32 on for their own matmuls only (the
setting is read as each cuBLAS call is made). On the CPU it is a plain fp32 matmul.

TF32 keeps fp32's range and a 10-bit mantissa, with fp32 accumulation: more than the bf16 inputs
many trainers route with, less than full fp32 (near-ties in the top-k may flip).
"""

from __future__ import annotations

import torch


class _TF32:
    """TF32 for CUDA matmuls inside the block, the previous setting restored after."""

    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


@torch.library.custom_op("moe_ladder::mm_tf32", mutates_args=())
def mm_tf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2-d, fp32) with TF32 tensor cores on a GPU."""
    with _TF32():
        return a @ b


@mm_tf32.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    a, b = ctx.saved_tensors
    return mm_tf32(g, b.t()), mm_tf32(a.t(), g)


mm_tf32.register_autograd(_backward, setup_context=_setup)
