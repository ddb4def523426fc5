"""engines/torch/kernels/topk.py: the router's top-k kernel selects what torch.topk selects, highest
first, and on ties the lowest expert first. On the CPU (no Triton) topk_indices is torch.topk;
the kernel runs on a GPU, eager and inside torch.compile."""

import pytest
import torch

from engines.torch.kernels.topk import topk_indices
from tests.engines.triton_script import run_script


def test_without_a_gpu_the_selection_is_torch_topk():
    x = torch.randn(37, 24, generator=torch.Generator().manual_seed(0))
    assert torch.equal(topk_indices(x, 5), torch.topk(x, 5, dim=-1).indices)


_KERNEL = """
import torch
from engines.torch.kernels import topk as K
assert K._OPS
torch.manual_seed(0)
for T, E, k in ((32768, 384, 8), (16384, 64, 8), (1000, 100, 3), (7, 16, 16), (5, 2, 2)):
    x = torch.rand(T, E, device="cuda")
    got = K.topk_indices(x, k)
    assert got.dtype == torch.int64 and got.shape == (T, k)
    # the same values, highest first (fp32 rand has ties within some rows: only their order differs)
    assert torch.equal(x.gather(1, got), torch.topk(x, k, dim=-1).values), (T, E, k)
    assert all(len(set(r)) == k for r in got.tolist()), (T, E, k)  # no expert twice
    untied = (x.unsqueeze(-1) == x.unsqueeze(1)).sum((1, 2)) == E if T * E * E < 2**28 else None
    if untied is not None:
        assert torch.equal(got[untied], torch.topk(x, k, dim=-1).indices[untied]), (T, E, k)
    assert torch.equal(torch.compile(K.topk_indices, dynamic=False)(x, k), got), (T, E, k)
# ties: the same values as torch.topk's, the lowest tied expert first
x = torch.randint(0, 4, (4096, 64), device="cuda").float()
got = K.topk_indices(x, 8)
vals = x.gather(1, got)
assert torch.equal(vals, torch.topk(x, 8, dim=-1).values)
same = vals[:, 1:] == vals[:, :-1]
assert bool((got[:, 1:][same] > got[:, :-1][same]).all())
assert all(len(set(r)) == 8 for r in got.tolist())  # no expert twice
# NaN scores (a diverged router): every index stays in [0, E), rows without NaN are untouched
x = torch.rand(4096, 64, device="cuda")
x[::3] = float("nan")
x[1::3, 5] = float("nan")
got = K.topk_indices(x, 8)
assert bool(((got >= 0) & (got < 64)).all())
assert torch.equal(x[2::3].gather(1, got[2::3]), torch.topk(x[2::3], 8, dim=-1).values)
assert not bool((got[1::3] == 5).any())  # a NaN score ranks last
try:
    K.launch_topk(x, torch.empty(4096, 65, device="cuda", dtype=torch.int64))
    raise SystemExit("K > E was accepted")
except ValueError as err:
    assert "0 < K <= E" in str(err)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_selects_what_torch_topk_selects_on_the_gpu():
    run_script(_KERNEL)
