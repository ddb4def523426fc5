"""engines/torch/kernels/tf32.py: mm_tf32 is a matmul with a matmul's gradients (torch.library.opcheck
checks its registrations), leaves the process-wide TF32 setting as it found it, and on a GPU
rounds its inputs as TF32 does while an fp32 matmul next to it stays fp32."""

import pytest
import torch

from engines.torch.kernels.tf32 import mm_tf32


def test_mm_tf32_is_a_matmul_with_its_gradients():
    torch.manual_seed(0)
    a = torch.randn(7, 5, dtype=torch.float32, requires_grad=True)
    b = torch.randn(5, 3, dtype=torch.float32, requires_grad=True)
    g = torch.randn(7, 3)
    got = mm_tf32(a, b)
    ga, gb = torch.autograd.grad(got, (a, b), g)
    want = a @ b
    wa, wb = torch.autograd.grad(want, (a, b), g)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(ga, wa)
    torch.testing.assert_close(gb, wb)
    torch.library.opcheck(mm_tf32, (a.detach().requires_grad_(), b.detach().requires_grad_()))


def test_the_process_setting_is_restored():
    before = torch.backends.cuda.matmul.allow_tf32
    mm_tf32(torch.ones(2, 2), torch.ones(2, 2))
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_only_the_op_uses_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    a = torch.randn(512, 1024, device="cuda")
    b = torch.randn(1024, 64, device="cuda")
    exact = (a.double() @ b.double()).float()
    err_op = ((mm_tf32(a, b) - exact).abs().max() / exact.abs().max()).item()
    err_fp32 = ((a @ b - exact).abs().max() / exact.abs().max()).item()
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert err_fp32 < 1e-5 < err_op < 5e-3, (err_fp32, err_op)
    compiled = torch.compile(lambda a, b: mm_tf32(a, b) * 2.0)
    torch.testing.assert_close(compiled(a, b), mm_tf32(a, b) * 2.0)
