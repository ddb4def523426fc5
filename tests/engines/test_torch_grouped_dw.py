"""engines/torch/kernels/grouped_dw.py: the grouped weight gradient equals one matmul per expert over its
rows (an expert without rows gets zeros; sizes off the tile grid are masked), in Triton's
interpreter on the CPU where Triton is installed and as a compiled kernel on a GPU; on a GPU,
GroupedMM's forward and gradients equal _grouped_mm's, compiled or not."""

import pytest
import torch

from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script

_KERNEL = """
import sys
import torch
from engines.torch.kernels import grouped_dw as D
dev = sys.argv[1]
torch.manual_seed(0)
offs = torch.cumsum(torch.tensor([5, 0, 70, 33, 1]), 0).to(dev, torch.int32)
A, K, N = int(offs[-1]), 40, 72  # neither width a multiple of a tile
# (the interpreter's bf16 arithmetic is not the GPU's: fp16 stands in for it there)
for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
    x = torch.randn(A, K).to(dev, dtype)
    dy = torch.randn(A, N).to(dev, dtype)
    ref = D.grouped_dw_torch(x, dy, offs)
    for config in ((32, 32, 16, 4, 2), (16, 64, 32, 4, 2)):
        dw = torch.full((5, K, N), float("nan"), device=dev, dtype=dtype)
        D.launch_grouped_dw(x, dy, offs, dw, config)
        # 16-bit outputs; on a GPU, tl.dot reads fp32 inputs as TF32
        tol = 2e-2 if dtype != torch.float32 else (5e-3 if dev == "cuda" else 1e-5)
        torch.testing.assert_close(dw.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        assert torch.equal(dw[1], torch.zeros_like(dw[1]))  # the expert without rows
    # x's rows read through an index (the dispatch's gather inside the kernel)
    x_T = torch.randn(37, K).to(dev, dtype)
    idx = torch.randint(0, 37, (A,)).to(dev)
    dw = torch.full((5, K, N), float("nan"), device=dev, dtype=dtype)
    D.launch_grouped_dw(x_T, dy, offs, dw, (32, 32, 16, 4, 2), idx_A=idx)
    ref = D.grouped_dw_torch(x_T, dy, offs, idx)
    torch.testing.assert_close(dw.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
try:
    D.launch_grouped_dw(x, dy.t().contiguous().t(), offs, dw)
    raise SystemExit("a strided dy was accepted")
except ValueError as err:
    assert "contiguous" in str(err)
print("ok")
"""


@interpreter_only
def test_grouped_dw_equals_a_matmul_per_expert_in_the_interpreter():
    pytest.importorskip("triton")
    run_script(_KERNEL, "cpu", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_dw_equals_a_matmul_per_expert_on_the_gpu():
    run_script(_KERNEL, "cuda")


_GROUPED_MM = """
import torch
from engines.torch.kernels import grouped_dw as D
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
offs = torch.cumsum(torch.tensor([300, 0, 517, 128, 64, 1000, 7, 256]), 0).to(dev, torch.int32)
A, K, N = int(offs[-1]), 256, 384
x0 = torch.randn(A, K, device=dev, dtype=bf)
w0 = torch.randn(8, K, N, device=dev, dtype=bf) / K**0.5
dy = torch.randn(A, N, device=dev, dtype=bf)


def grads(fn):
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    y = fn(x, w)
    y.backward(dy)
    return y, x.grad, w.grad


ref = grads(lambda x, w: torch._grouped_mm(x, w, offs=offs))
assert D.kernel_usable(x0)
for fn, scale in ((lambda x, w: D.grouped_mm(x, w, offs), 1.0),
                  (torch.compile(lambda x, w: D.grouped_mm(x, w, offs) * 2.0), 2.0)):  # (x 2: exact in bf16)
    got = grads(fn)
    assert torch.equal(got[0], ref[0] * scale)
    torch.testing.assert_close(got[1], ref[1] * scale, rtol=0, atol=0)
    torch.testing.assert_close(got[2].float(), ref[2].float() * scale, rtol=1e-2, atol=1e-2)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_gradients_equal_grouped_mm_s_eager_and_compiled():
    run_script(_GROUPED_MM, "cuda")
