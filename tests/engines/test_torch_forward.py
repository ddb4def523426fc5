"""The torch model's one forward (engines/torch/forward.py): on the CPU in fp32 it gives a naive
forward's objective, metrics and gradients (tests/engines/naive_forward.py), and every kernel
choice, the reference one (TorchKernels.reference()) included, reaches the same objective."""

import dataclasses

import pytest
import torch

from engines.data import TokenStream
from engines.options import TorchKernels
from engines.torch.experts import kernels_here
from engines.torch.forward import Forward, _sdpa, window_block_mask
from engines.torch.model import MoETransformer, attention_mask, init_params
from engines.torch.step import TorchStep, eval_losses
from ladder.presets import micro_spec
from tests.engines.naive_forward import naive_loss

VARIANTS = {
    "latent+shared+window": {},
    "plain causal, sigmoid, sequence balance": {
        "model.latent_dim": None, "model.n_shared_experts": 0, "model.attention_window": None,
        "model.router_kind": "sigmoid", "model.balance_scope": "sequence", "model.n_kv_heads": 4},
}
CPU = torch.device("cpu")


def _model_and_batch(spec):
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, spec.seed))
    return model, torch.from_numpy(TokenStream.from_spec(spec).batch(0)).long()


def _loss_and_grads(fn, model, x, optim):
    model.zero_grad(set_to_none=True)
    total, out = fn(model, x, optim)
    total.backward()
    return total.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _same(a, b, metrics: bool = True):
    (t_a, o_a, g_a), (t_b, o_b, g_b) = a, b
    assert torch.allclose(t_b, t_a, rtol=1e-6, atol=1e-6)
    if metrics:
        for k, v in o_a["metrics"].items():
            assert torch.allclose(o_b["metrics"][k], v, rtol=1e-5, atol=1e-6), k
        assert torch.equal(o_b["load_LE"], o_a["load_LE"])
    assert any(n.endswith("moe.router") for n in g_a) and any(n.endswith("attn.wq") for n in g_a)
    for name, g in g_a.items():
        assert torch.allclose(g_b[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_forward_gives_the_naive_forwards_objective_metrics_and_gradients(variant):
    spec = micro_spec(**VARIANTS[variant])
    model, x = _model_and_batch(spec)
    naive = _loss_and_grads(naive_loss, model, x, spec.optim)
    _same(naive, _loss_and_grads(Forward(CPU), model, x, spec.optim))


def test_capacity_dispatch_with_room_for_every_assignment_gives_the_naive_forward():
    spec = micro_spec(**{"model.dispatch": "capacity", "model.capacity_factor_recv": 8.0,
                         "model.capacity_factor_send": 8.0})
    model, x = _model_and_batch(spec)
    got = _loss_and_grads(Forward(CPU), model, x, spec.optim)
    assert float(got[1]["metrics"]["drop_frac_recv"]) == 0
    _same(_loss_and_grads(naive_loss, model, x, spec.optim), got)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_default_kernels_reach_the_reference_kernels_objective(dispatch, variant):
    spec = micro_spec(**{"model.dispatch": dispatch, "model.capacity_factor_recv": 1.0, **VARIANTS[variant]})
    model, x = _model_and_batch(spec)
    ref = _loss_and_grads(Forward(CPU, TorchKernels.reference()), model, x, spec.optim)
    if dispatch == "capacity":
        assert float(ref[1]["metrics"]["drop_frac_recv"]) > 0  # the drops are exercised, not vacuous
    _same(ref, _loss_and_grads(Forward(CPU, kernels_here(TorchKernels())), model, x, spec.optim))


@pytest.mark.parametrize("option", [{"router": "tf32"}, {"router": "fp32"}, {"rope_layout": "bshq"},
                                    {"gather": "triton"}],
                         ids=["router through the tf32 op", "router fp32", "rope on [B, S, H, Q]",
                              "the gather kernels' torch forms"])
def test_each_kernel_choice_reaches_the_reference_kernels_objective(option):
    spec = micro_spec()
    model, x = _model_and_batch(spec)
    kernels = dataclasses.replace(TorchKernels.reference(), **option)
    _same(_loss_and_grads(Forward(CPU, TorchKernels.reference()), model, x, spec.optim),
          _loss_and_grads(Forward(CPU, kernels), model, x, spec.optim))


def test_capacity_dispatch_through_the_gather_kernels_path_matches_the_reference_kernels():
    """Capacity mode with gather "triton" (on the CPU, gather.py's torch forms behind the same
    backward): the zero rows of unfilled buffer rows and dropped assignments get no gradient."""
    spec = micro_spec(**{"model.dispatch": "capacity", "model.capacity_factor_recv": 1.0})
    model, x = _model_and_batch(spec)
    kernels = dataclasses.replace(TorchKernels.reference(), gather="triton")
    ref = _loss_and_grads(Forward(CPU, TorchKernels.reference()), model, x, spec.optim)
    assert float(ref[1]["metrics"]["drop_frac_recv"]) > 0
    _same(ref, _loss_and_grads(Forward(CPU, kernels), model, x, spec.optim), metrics=False)


@pytest.mark.parametrize("seq, window", [(384, 130), (256, 128), (200, 64), (256, None)])
def test_flex_window_block_mask_gives_the_dense_masks_attention(seq, window):
    """FlexAttention with window_block_mask (the GPU's windowed attention) attends exactly where
    model.attention_mask allows: its output equals SDPA's with the dense mask (here in eager fp32
    on the CPU, which has no FlexAttention backward; tests/engines/test_gpu_bf16.py checks the
    gradients on a GPU), with windows that skip whole blocks, end mid-block and on a boundary."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, seq, 16, generator=g) for n in (4, 1, 1))
    o_flex = _sdpa(q, k, v, window_block_mask(seq, window, "cpu"), gqa=True)
    o_dense = _sdpa(q, k, v, attention_mask(seq, window, "cpu"), gqa=True)
    o_causal = _sdpa(q, k, v, None, gqa=True)
    assert torch.allclose(o_flex, o_dense, rtol=1e-5, atol=1e-5)
    assert torch.allclose(o_flex, o_causal, rtol=1e-5, atol=1e-5) == (window is None)  # the window cuts


def test_the_cpu_forward_keeps_the_dense_window_mask():
    spec = micro_spec()
    assert spec.model.attention_window is not None and spec.model.attention_window < spec.data.seq_len
    _, _, mask = Forward(CPU).tables(spec.data.seq_len, spec.model, "cpu")
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_eval_scores_each_batch_as_a_forward_of_that_batch_alone(dispatch):
    """TorchStep.eval_losses (under dropless dispatch the rows of all batches in training-batch
    forwards, the last filled up with copies; under capacity each batch alone) gives each eval
    batch the mean CE of a forward of that batch alone."""
    spec = micro_spec(**{"model.dispatch": dispatch})
    step = TorchStep(spec, CPU)
    step.init_fresh()
    stream = TokenStream.from_spec(spec)
    plan = stream.eval_plan(None)[:5]
    batches = [stream.eval_batch(src, rows, spec.data.seq_len) for src, rows in plan]
    batches[-1] = batches[-1][:3]  # a short batch: the last forward is filled up
    got = step.eval_losses(batches)
    with torch.no_grad():
        alone = [float(step.loss_fn.forward(step.model, torch.from_numpy(b).long())[0]) for b in batches]
    assert len(got) == len(batches)
    assert got == pytest.approx(alone, rel=1e-5)
    assert len(set(round(v, 6) for v in got)) > 1  # the batches differ, so a mix-up would show
    assert eval_losses(step.loss_fn, step.model, [], spec.data.batch_size, CPU) == []
