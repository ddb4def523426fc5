"""engines/torch/kernels/swiglu.py: the SwiGLU backward kernel equals the derivative of silu(gate) * up.
The torch form is checked by autograd in fp64 on any machine; the kernel against the torch form in
Triton's interpreter where Triton is installed (widths off the block grid, a row count off
BLOCK_R) and on a GPU, where SwiGLU's gradient also equals autograd's, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F

from engines.torch.kernels.swiglu import swiglu_bwd_torch
from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script


def test_the_torch_form_is_the_derivative_of_silu_gate_times_up():
    torch.manual_seed(0)
    gu = torch.randn(13, 2 * 7, dtype=torch.float64, requires_grad=True)
    dh = torch.randn(13, 7, dtype=torch.float64)
    (F.silu(gu[:, :7]) * gu[:, 7:]).backward(dh)
    torch.testing.assert_close(swiglu_bwd_torch(gu.detach(), dh), gu.grad)


_KERNEL = """
import sys
import torch
from engines.torch.kernels import swiglu as S
dev = sys.argv[1]
torch.manual_seed(0)
# (the interpreter's bf16 arithmetic is not the GPU's: fp16 stands in for it there)
for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
    for A, Fh in ((21, 40), (3, 1100)):  # rows off BLOCK_R; widths off the block, and wider than one
        gu = (3 * torch.randn(A, 2 * Fh)).to(dev, dtype)
        dh = torch.randn(A, Fh).to(dev, dtype)
        out = torch.full_like(gu, float("nan"))
        S.launch_swiglu_bwd(gu, dh, out)
        want = S.swiglu_bwd_torch(gu, dh)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
try:
    S.launch_swiglu_bwd(gu, dh[:, :-1], out)
    raise SystemExit("mismatched shapes were accepted")
except ValueError as err:
    assert "want [A, 2F]" in str(err)
if dev == "cuda":
    import torch.nn.functional as F
    gu = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    dh = torch.randn(4096, 512, device=dev, dtype=torch.bfloat16)
    leaf = gu.clone().requires_grad_(True)
    (F.silu(leaf[:, :512]) * leaf[:, 512:]).backward(dh)
    for fn in (S.swiglu, torch.compile(S.swiglu)):
        leaf2 = gu.clone().requires_grad_(True)
        h = fn(leaf2)
        h.backward(dh)
        torch.testing.assert_close(h, F.silu(gu[:, :512]) * gu[:, 512:])
        torch.testing.assert_close(leaf2.grad.float(), leaf.grad.float(), rtol=2e-2, atol=2e-2)
print("ok")
"""


@interpreter_only
def test_the_kernel_equals_the_torch_form_in_the_interpreter():
    pytest.importorskip("triton")
    run_script(_KERNEL, "cpu", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_equals_the_torch_form_on_the_gpu():
    run_script(_KERNEL, "cuda")
