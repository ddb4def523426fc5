"""engines/torch/kernels/swiglu_gemm.py: the experts' SwiGLU inside the grouped matmuls equals the plain
formula. Its torch forms are the derivative of silu(gate) * up (checked by autograd in fp64, on
any machine); the kernels equal the torch forms in Triton's interpreter where Triton is installed
(an expert without rows, widths off the tile grid) and on a GPU; there, FusedExperts' output and
gradients equal the unfused grouped matmuls', eager and compiled."""

import pytest
import torch
import torch.nn.functional as F

from engines.torch.kernels.swiglu_gemm import swiglu_down_dx_torch, swiglu_up_torch
from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script


def _experts_fp64(x, w_gu, w_down, offs):
    Fh, out, start = w_down.shape[1], [], 0
    for e, stop in enumerate(offs.tolist()):
        gu = x[start:stop] @ w_gu[e]
        out.append((F.silu(gu[:, :Fh]) * gu[:, Fh:]) @ w_down[e])
        start = stop
    return torch.cat(out)


def test_the_torch_forms_are_the_swiglu_and_its_derivative():
    torch.manual_seed(0)
    offs = torch.cumsum(torch.tensor([3, 0, 9, 4]), 0).to(torch.int32)
    A, L, Fh = int(offs[-1]), 6, 5
    x = torch.randn(A, L, dtype=torch.float64)
    w_gu = torch.randn(4, L, 2 * Fh, dtype=torch.float64)
    w_down = torch.randn(4, Fh, L, dtype=torch.float64)
    dy = torch.randn(A, L, dtype=torch.float64)
    gu, h = swiglu_up_torch(x, w_gu, offs)
    y = torch.cat([h[a:b] @ w_down[e] for e, (a, b) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    torch.testing.assert_close(y, _experts_fp64(x, w_gu, w_down, offs))
    gu_leaf = gu.clone().requires_grad_(True)
    h2 = F.silu(gu_leaf[:, :Fh]) * gu_leaf[:, Fh:]
    y2 = torch.cat([h2[a:b] @ w_down[e] for e, (a, b) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    y2.backward(dy)
    torch.testing.assert_close(swiglu_down_dx_torch(dy, w_down, gu, offs), gu_leaf.grad)


_KERNELS = """
import sys
import torch
from engines.torch.kernels import swiglu_gemm as S
dev = sys.argv[1]
torch.manual_seed(0)
offs = torch.cumsum(torch.tensor([5, 0, 70, 33, 1]), 0).to(dev, torch.int32)
A, L, Fh, E = int(offs[-1]), 48, 40, 5  # neither width a multiple of a tile
# (the interpreter's bf16 arithmetic is not the GPU's: fp16 stands in for it there)
for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
    x = torch.randn(A, L).to(dev, dtype)
    w_gu = (torch.randn(E, L, 2 * Fh) / L**0.5).to(dev, dtype)
    w_down = (torch.randn(E, Fh, L) / Fh**0.5).to(dev, dtype)
    dy = torch.randn(A, L).to(dev, dtype)
    # 16-bit outputs: one rounding apart; on a GPU, tl.dot reads fp32 inputs as TF32
    tol = 2e-2 if dtype != torch.float32 else (5e-3 if dev == "cuda" else 1e-5)
    ref_gu, ref_h = S.swiglu_up_torch(x, w_gu, offs)
    ref_dgu = S.swiglu_down_dx_torch(dy, w_down, ref_gu, offs)
    for config in ((16, 32, 16, 4, 2), (32, 16, 32, 4, 2)):
        gu = torch.full((A, 2 * Fh), float("nan"), device=dev, dtype=dtype)
        h = torch.full((A, Fh), float("nan"), device=dev, dtype=dtype)
        S.launch_swiglu_up(x, w_gu, offs, gu, h, config)
        torch.testing.assert_close(gu.float(), ref_gu.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(h.float(), ref_h.float(), rtol=tol, atol=tol)
        dgu = torch.full((A, 2 * Fh), float("nan"), device=dev, dtype=dtype)
        S.launch_swiglu_down_dx(dy, w_down, ref_gu, offs, dgu, config)
        torch.testing.assert_close(dgu.float(), ref_dgu.float(), rtol=tol, atol=tol * ref_dgu.abs().max().item())
    # the plain grouped matmul, with the weights as stored and through a transposed view
    for w, n in ((w_gu, 2 * Fh), (w_down.transpose(-2, -1), Fh)):
        xin = x if w is w_gu else dy
        y = torch.full((A, n), float("nan"), device=dev, dtype=dtype)
        S.launch_grouped_mm(xin, w, offs, y, (16, 32, 16, 4, 2))
        want = torch.cat([xin[a:b].float() @ w[e].float()
                          for e, (a, b) in enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
        torch.testing.assert_close(y.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    # the rows read through an index (the dispatch's gather inside the kernel)
    x_T = torch.randn(29, L).to(dev, dtype)
    idx = torch.randint(0, 29, (A,)).to(dev)
    gu = torch.full((A, 2 * Fh), float("nan"), device=dev, dtype=dtype)
    h = torch.full((A, Fh), float("nan"), device=dev, dtype=dtype)
    S.launch_swiglu_up(x_T, w_gu, offs, gu, h, (16, 32, 16, 4, 2), idx_A=idx)
    ref_gu, ref_h = S.swiglu_up_torch(x_T, w_gu, offs, idx)
    torch.testing.assert_close(gu.float(), ref_gu.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(h.float(), ref_h.float(), rtol=tol, atol=tol)
try:
    S.launch_swiglu_up(x.t().contiguous().t(), w_gu, offs, gu, h)
    raise SystemExit("a strided x was accepted")
except ValueError as err:
    assert "contiguous" in str(err)
print("ok")
"""


@interpreter_only
def test_kernels_equal_the_torch_forms_in_the_interpreter():
    pytest.importorskip("triton")
    run_script(_KERNELS, "cpu", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_equal_the_torch_forms_on_the_gpu():
    run_script(_KERNELS, "cuda")


_FUSED = """
import torch
import torch.nn.functional as F
from engines.torch.kernels import swiglu_gemm as S
torch.manual_seed(0)
dev, bf = "cuda", torch.bfloat16
offs = torch.cumsum(torch.tensor([300, 0, 517, 128, 64, 1000, 7, 256]), 0).to(dev, torch.int32)
A, L, Fh = int(offs[-1]), 256, 192
assert S.kernels_usable(torch.empty(1, device=dev))
params = [torch.randn(A, L, device=dev, dtype=bf), torch.randn(8, L, 2 * Fh, device=dev, dtype=bf) / L**0.5,
          torch.randn(8, Fh, L, device=dev, dtype=bf) / Fh**0.5]
dy = torch.randn(A, L, device=dev, dtype=bf)


def unfused(x, w_gu, w_down):
    gu = torch._grouped_mm(x, w_gu, offs=offs)
    return torch._grouped_mm(F.silu(gu[:, :Fh]) * gu[:, Fh:], w_down, offs=offs)


def grads(fn):
    leaves = [p.clone().requires_grad_(True) for p in params]
    y = fn(*leaves)
    y.backward(dy)
    return [y] + [t.grad for t in leaves]


def check(got_all, want_all):
    for name, got, want in zip(("y", "dx", "dw_gu", "dw_down"), got_all, want_all):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item(),
                                   msg=name)


ref = grads(unfused)
for fn in (lambda *a: S.fused_experts(*a, offs), torch.compile(lambda *a: S.fused_experts(*a, offs))):
    check(grads(fn), ref)

# from the tokens' rows: K = 2 slots a token, the sorted rows' tokens src_A, inverse inv_A
K = 2
T = A // K
src_A = torch.randperm(A, device=dev)  # a sorted row's (token, slot), token-major
inv_A = torch.empty_like(src_A).scatter_(0, src_A, torch.arange(A, device=dev))
src_A = src_A // K
params[0] = torch.randn(T, L, device=dev, dtype=bf)


def unfused_tokens(x_TL, w_gu, w_down):
    return unfused(x_TL.index_select(0, src_A), w_gu, w_down)


ref = grads(unfused_tokens)
for fn in (lambda *a: S.fused_dispatch_experts(a[0], src_A, inv_A, K, a[1], a[2], offs),
           torch.compile(lambda *a: S.fused_dispatch_experts(a[0], src_A, inv_A, K, a[1], a[2], offs))):
    check(grads(fn), ref)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_experts_equal_the_unfused_grouped_matmuls_eager_and_compiled():
    run_script(_FUSED, "cuda")
