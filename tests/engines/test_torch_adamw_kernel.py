"""engines/torch/kernels/adamw_kernel.py: MasterAdamW's update as one Triton kernel per tensor trains like
the torch form of the same update (weights, moments, working copies), and a step flagged non-finite
changes nothing. Run in Triton's interpreter on the CPU where Triton is installed, and on a GPU
where there is one; the stride rules are checked everywhere."""

import pytest
import torch

from engines.torch.kernels.adamw_kernel import _row_stride
from tests.engines.triton_script import INTERPRETER, interpreter_only, run_script


def test_a_slice_of_a_leaf_is_read_in_rows_of_the_leaf_width():
    leaf = torch.zeros(3, 4, 10)
    assert _row_stride(leaf[..., 2:6], 4) == 10
    assert _row_stride(torch.zeros(5), 5) == 5
    with pytest.raises(ValueError, match="columns must be contiguous"):
        _row_stride(leaf.transpose(-1, -2), 4)
    with pytest.raises(ValueError, match="not evenly strided"):
        _row_stride(leaf[:, :2, 2:6], 4)


_SCRIPT = """
import sys
import torch
from engines.data import TokenStream
from engines.torch.step import launch_step, make_loss_fn, read_step, queue_update
from engines.torch.master import MasterAdamW, adamw_group_kernels_, build_optimizer, weight_layout
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec

dev = torch.device(sys.argv[1])
dtype = getattr(torch, sys.argv[2])  # the working copies'
moments = getattr(torch, sys.argv[3])
# bf16 moments: the kernel's and torch's fp32 arithmetic may round a moment to neighbouring bf16
# values (one bf16 step, 2^-8), which moves the master by about that share of one update
m_tol, p_atol = ({"rtol": 1e-5, "atol": 1e-9}, 1e-7) if moments == torch.float32 else ({"rtol": 8e-3, "atol": 1e-9}, 1e-5)
spec = micro_spec(**{"optim.grad_clip": 0.05, "optim.weight_decay": 0.1})
stream = TokenStream.from_spec(spec)
runs = []
for kernel in ("compile", "triton"):
    model = MoETransformer(spec.model).to(dev)
    model.load_numpy(init_params(spec.model, spec.seed))
    plain = build_optimizer(model, spec.optim)
    opt = MasterAdamW(model, plain.param_groups, lr=spec.optim.peak_lr, betas=(spec.optim.beta1, spec.optim.beta2),
                      eps=spec.optim.eps, dtype=dtype, compile=False, kernel=kernel,
                      moments=moments)
    assert (opt._update is adamw_group_kernels_) == (kernel == "triton")
    runs.append((model, opt))
(ref, ref_opt), (got, got_opt) = runs
fn = make_loss_fn(ref, dev, ref_opt)
for s in range(3):
    # the same gradients go to both updates (a GPU backward need not repeat itself bit for bit,
    # and one Adam step turns a last-bit gradient difference near zero into a visible one)
    x = torch.from_numpy(stream.batch(s)).long().to(dev)
    vals, out = launch_step(ref, fn, x, spec, ref_opt)
    for name, leaf in got_opt.working().items():
        leaf.grad = ref_opt.working()[name].grad.clone()
    for p, q in zip(got.parameters(), ref.parameters()):
        p.grad = None if q.grad is None else q.grad.clone()
    _, got_mult = got_opt.grad_norm_and_scale(spec.optim.grad_clip)
    assert torch.equal(got_mult, out["clip_mult"])
    m, finite = read_step(ref_opt, queue_update(ref, ref_opt, vals, out, spec))
    got_opt.step(got_mult, finite=torch.ones((), dtype=torch.bool, device=dev))
    got_opt.zero_grad()
    assert finite
for (name, p), q in zip(got.named_parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=p_atol, msg=name)
    for key in ("exp_avg", "exp_avg_sq"):
        assert got_opt.state[p][key].dtype == moments
        torch.testing.assert_close(got_opt.state[p][key], ref_opt.state[q][key], **m_tol, msg=name)
for name, leaf in got_opt.working().items():  # the copies hold the new masters, rounded
    assert torch.equal(leaf.detach(), torch.cat(weight_layout(got)[name], -1).detach().to(dtype)), name

# a step flagged non-finite changes no master, moment or working copy
x = torch.from_numpy(stream.batch(3)).long().to(dev)
total, out = make_loss_fn(got, dev, got_opt)(got, x, spec.optim)
total.backward()
before = [t.clone() for p in got.parameters() for t in (p, got_opt.state[p]["exp_avg"], got_opt.state[p]["exp_avg_sq"])]
copies = [leaf.detach().clone() for leaf in got_opt.working().values()]
got_opt.step(torch.ones((), device=dev), finite=torch.zeros((), dtype=torch.bool, device=dev))
after = [t for p in got.parameters() for t in (p, got_opt.state[p]["exp_avg"], got_opt.state[p]["exp_avg_sq"])]
assert all(torch.equal(a, b) for a, b in zip(before, after))
assert all(torch.equal(a, b.detach()) for a, b in zip(copies, got_opt.working().values()))
print("ok")
"""


@interpreter_only
def test_kernel_update_trains_like_the_torch_form_in_the_interpreter():
    pytest.importorskip("triton")
    # (bf16 moments only on a GPU: the interpreter's bf16 rounding is not the GPU's)
    run_script(_SCRIPT, "cpu", "float32", "float32", **INTERPRETER)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, moments", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")])
def test_kernel_update_trains_like_the_torch_form_on_the_gpu(dtype, moments):
    run_script(_SCRIPT, "cuda", dtype, moments)
