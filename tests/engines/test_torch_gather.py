"""engines/torch/kernels/gather.py: the combine's gather-and-sum with hand-written backward, and its
Triton kernels. On the CPU: the Combine function's gradients equal autograd's through the plain
gather + sum, the forward with gather="triton" (the torch forms here) equals it with the
reference kernels, and, where Triton is installed, the kernels run in Triton's interpreter and equal the torch
forms, directly and through the registered ops."""

import pytest
import torch

from engines.data import TokenStream
from engines.options import TorchKernels
from engines.torch.forward import Forward
from engines.torch.kernels.gather import Combine
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec
from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script


def _case(T=6, K=3, L=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    order_A = torch.randperm(T * K, generator=g)  # the (token-major) assignment of each sorted row
    inv_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(T * K))
    y_AL = torch.randn(T * K, L, dtype=dtype, generator=g, requires_grad=True)
    gate_TK = torch.rand(T, K, dtype=dtype, generator=g, requires_grad=True)
    return y_AL, gate_TK, inv_A, order_A


def test_combine_gradients_equal_autograd_through_gather_and_sum():
    y_AL, gate_TK, inv_A, order_A = _case()
    T, K = gate_TK.shape
    want = (y_AL[inv_A].view(T, K, -1) * gate_TK.unsqueeze(-1)).sum(1)
    got = Combine.apply(y_AL, gate_TK, inv_A, order_A, False)
    torch.testing.assert_close(got, want.float())
    g_TL = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (y_AL, gate_TK), g_TL)
    got_grads = torch.autograd.grad(Combine.apply(y_AL, gate_TK, inv_A, order_A, False), (y_AL, gate_TK), g_TL.float())
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)
    # the rows' gradient through gather_scale's path (its torch form here) is the same
    got_scaled = torch.autograd.grad(Combine.apply(y_AL, gate_TK, inv_A, order_A, True, True), (y_AL, gate_TK),
                                     g_TL.float())
    for a, b in zip(got_scaled, want_grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("combine_grad", ["inductor", "triton"])
def test_the_forward_with_the_gather_ops_matches_the_reference_kernels(combine_grad):
    spec = micro_spec(**{"model.dispatch": "dropless"})
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, spec.seed))
    x = torch.from_numpy(TokenStream.from_spec(spec).batch(0)).long()
    grads = []
    kernels = TorchKernels(gather="triton", combine_grad=combine_grad, compile="block")
    for fn in (Forward(torch.device("cpu"), TorchKernels.reference()), Forward(torch.device("cpu"), kernels)):
        model.zero_grad(set_to_none=True)
        total, _ = fn(model, x, spec.optim)
        total.backward()
        grads.append((total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (t_ref, g_ref), (t_fast, g_fast) = grads
    assert torch.allclose(t_fast, t_ref, rtol=1e-6, atol=1e-6)
    for name, g in g_ref.items():
        assert torch.allclose(g_fast[name], g, rtol=1e-4, atol=1e-6), name


_KERNELS = """
import sys
import torch
from engines.torch.kernels import gather as G
dev = sys.argv[1]
torch.manual_seed(0)
T, K, L = 7, 4, 300  # L not a power of two: the column masks are exercised
for dtype in (torch.float32, torch.float16):
    src = torch.randn(T * K, L).to(dev, dtype)
    idx = torch.randperm(T * K).view(T, K).to(dev)
    w = torch.rand(T, K).to(dev)
    g = torch.randn(T, L).to(dev)
    for weights in (w, None):
        out = torch.empty(T, L, device=dev)
        G.launch_gather_sum(src, idx, weights, out)
        torch.testing.assert_close(out, G.gather_sum_torch(src, idx, weights, torch.float32), rtol=1e-5, atol=1e-5)
    dots = torch.empty(T, K, device=dev)
    G.launch_gather_dot(src, idx, g, dots)
    torch.testing.assert_close(dots, G.gather_dot_torch(src, idx, g), rtol=1e-4, atol=1e-4)
    # the same through the registered ops (torch.library.triton_op + wrap_triton), as compiled code calls them
    assert G._OPS
    torch.testing.assert_close(torch.ops.moe_ladder.gather_sum(src, idx, w, torch.float32),
                               G.gather_sum_torch(src, idx, w, torch.float32), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.ops.moe_ladder.gather_dot(src, idx, g), G.gather_dot_torch(src, idx, g),
                               rtol=1e-4, atol=1e-4)
# the combine's backward for the sorted rows: 15 rows (not a multiple of a program's 4)
order = torch.randperm(15).to(dev)
gate = torch.rand(5, 3).to(dev)
g_TL = torch.randn(5, L).to(dev)
for out_dtype in (torch.float32, torch.bfloat16):
    rows = torch.empty(15, L, device=dev, dtype=out_dtype)
    G.launch_gather_scale(g_TL, order, gate, rows)
    want = G.gather_scale_torch(g_TL, order, gate, out_dtype)
    tol = 2.0 ** -7 if out_dtype == torch.bfloat16 else 0.0  # one bf16 rounding (the interpreter truncates)
    torch.testing.assert_close(rows, want, rtol=tol, atol=0)
    torch.testing.assert_close(torch.ops.moe_ladder.gather_scale(g_TL, order, gate, out_dtype), want, rtol=tol, atol=0)
print("ok")
"""


@interpreter_only
def test_triton_kernels_equal_the_torch_forms_in_the_interpreter():
    pytest.importorskip("triton")
    run_script(_KERNELS, "cpu", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_equal_the_torch_forms_on_the_gpu():
    run_script(_KERNELS, "cuda")
