"""engines/torch/kernels/xent.py: the head's losses and their gradient. The torch forms are the mean
cross-entropy, the mean squared log-partition and their gradient (autograd in fp64, any machine);
the kernels equal the torch forms in Triton's interpreter where Triton is installed (a vocabulary
over one block and off the block grid) and on a GPU, where HeadLosses' gradient also equals
autograd's, eager and compiled."""

import pytest
import torch

from engines.torch.kernels.xent import xent_bwd_torch, xent_fwd_torch
from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script


def test_the_torch_forms_are_the_losses_and_their_gradient():
    torch.manual_seed(0)
    logits = (3 * torch.randn(7, 11, dtype=torch.float64)).requires_grad_(True)
    tgt = torch.randint(0, 11, (7,))
    lse, tgt_logit = xent_fwd_torch(logits, tgt)
    ce = torch.nn.functional.cross_entropy(logits, tgt)
    z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close((lse - tgt_logit).mean(), ce)
    torch.testing.assert_close(lse.square().mean(), z)
    g = torch.tensor([0.7, 1.3], dtype=torch.float64)
    (g[0] * ce + g[1] * z).backward()
    torch.testing.assert_close(xent_bwd_torch(logits.detach(), tgt, lse.detach(), g), logits.grad)


_KERNELS = """
import sys
import torch
from engines.torch.kernels import xent as X
from engines.torch.loss import head_losses
dev = sys.argv[1]
torch.manual_seed(0)
# (the interpreter's bf16 arithmetic is not the GPU's: fp16 stands in for it there)
for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
    for T, V in ((5, 100), (3, X.BLOCK_V + 77)):
        logits = (4 * torch.randn(T, V)).to(dev, dtype)
        tgt = torch.randint(0, V, (T,)).to(dev)
        lse, tgt_logit = torch.empty(T, device=dev), torch.empty(T, device=dev)
        X.launch_xent_fwd(logits, tgt, lse, tgt_logit)
        want_lse, want_tl = X.xent_fwd_torch(logits, tgt)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tgt_logit, want_tl)
        g = torch.tensor([0.7, 1.3], device=dev)
        d = torch.full_like(logits, float("nan"))
        X.launch_xent_bwd(logits, tgt, want_lse, g, d)
        want = X.xent_bwd_torch(logits, tgt, want_lse, g)
        tol = 1e-6 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(d.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())
if dev == "cuda":
    T, V = 512, 50304
    logits = (4 * torch.randn(T, V, device=dev)).to(torch.bfloat16)
    tgt = torch.randint(0, V, (T,), device=dev)
    leaf = logits.float().requires_grad_(True)
    lse = torch.logsumexp(leaf, -1)
    ce, z = (lse - leaf.gather(-1, tgt[:, None])[:, 0]).mean(), lse.square().mean()
    (0.7 * ce + 1.3 * z).backward()
    def kernel_losses(logits_TV, tgt_T):
        return head_losses(logits_TV, tgt_T, kernel=True)
    for fn in (kernel_losses, torch.compile(kernel_losses)):
        leaf2 = logits.clone().requires_grad_(True)
        ce2, z2 = fn(leaf2, tgt)
        (0.7 * ce2 + 1.3 * z2).backward()
        torch.testing.assert_close(ce2, ce, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z2, z, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(leaf2.grad.float(), leaf.grad, rtol=2e-2, atol=2e-2 * leaf.grad.abs().max().item())
print("ok")
"""


@interpreter_only
def test_the_kernels_equal_the_torch_forms_in_the_interpreter():
    pytest.importorskip("triton")
    run_script(_KERNELS, "cpu", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernels_equal_the_torch_forms_on_the_gpu():
    run_script(_KERNELS, "cuda")
