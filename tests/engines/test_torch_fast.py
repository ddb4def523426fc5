"""The GPU fast path of the torch engine (engines/torch/fast.py) computes the reference model's
objective: run on the CPU in fp32 it gives model.loss_terms' loss, metrics and gradients."""

import dataclasses

import pytest
import torch

from engines.data import TokenStream
from engines.options import TorchKernels
from engines.torch.experts import kernels_here
from engines.torch.fast import FastLoss
from engines.torch.model import MoETransformer, init_params, loss_terms
from engines.torch.step import TorchStep, fast_eval_losses
from ladder.presets import micro_spec

VARIANTS = {
    "latent+shared+window": {},
    "plain causal, sigmoid, sequence balance": {
        "model.latent_dim": None, "model.n_shared_experts": 0, "model.attention_window": None,
        "model.router_kind": "sigmoid", "model.balance_scope": "sequence", "model.n_kv_heads": 4},
}


def _loss_and_grads(fn, model, x, optim):
    model.zero_grad(set_to_none=True)
    total, out = fn(model, x, optim)
    total.backward()
    return total.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _reference_and_fast(spec, kernels: TorchKernels | None = None):
    """(reference, fast) (total loss, outputs, gradients) of one batch on the CPU (the fast path
    with `kernels`, default the engine's)."""
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, spec.seed))
    x = torch.from_numpy(TokenStream.from_spec(spec).batch(0)).long()
    return (_loss_and_grads(loss_terms, model, x, spec.optim),
            _loss_and_grads(FastLoss(model, torch.device("cpu"), kernels), model, x, spec.optim))


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fast_path_matches_the_reference_forward_and_gradients(dispatch, variant):
    spec = micro_spec(**{"model.dispatch": dispatch, "model.capacity_factor_recv": 1.0, **VARIANTS[variant]})
    (t_ref, o_ref, g_ref), (t_fast, o_fast, g_fast) = _reference_and_fast(spec)
    assert torch.allclose(t_fast, t_ref, rtol=1e-6, atol=1e-6)
    for k, v in o_ref["metrics"].items():
        assert torch.allclose(o_fast["metrics"][k], v, rtol=1e-5, atol=1e-6), k
    assert torch.equal(o_fast["load_LE"], o_ref["load_LE"])
    if dispatch == "capacity":
        assert float(o_ref["metrics"]["drop_frac_recv"]) > 0  # the drops are exercised, not vacuous
    for name, g in g_ref.items():
        assert torch.allclose(g_fast[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("option", [{"router": "tf32"}, {"router": "fp32"}, {"rope_layout": "bshq"}],
                         ids=["router through the tf32 op", "router fp32", "rope on [B, S, H, Q]"])
def test_each_fast_path_option_reaches_the_same_objective(option):
    (t_ref, _, g_ref), (t_fast, _, g_fast) = _reference_and_fast(micro_spec(), kernels_here(TorchKernels(**option)))
    assert torch.allclose(t_fast, t_ref, rtol=1e-6, atol=1e-6)
    assert any(n.endswith("moe.router") for n in g_ref) and any(n.endswith("attn.wq") for n in g_ref)
    for name, g in g_ref.items():
        assert torch.allclose(g_fast[name], g, rtol=1e-4, atol=1e-6), name


def test_capacity_dispatch_through_the_gather_kernels_path_matches_the_reference():
    """Capacity mode with gather "triton" (on the CPU, gather.py's torch forms behind the same
    backward): the zero rows of unfilled buffer rows and dropped assignments get no gradient."""
    spec = micro_spec(**{"model.dispatch": "capacity", "model.capacity_factor_recv": 1.0})
    kernels = dataclasses.replace(kernels_here(TorchKernels()), gather="triton")
    (t_ref, o_ref, g_ref), (t_fast, _, g_fast) = _reference_and_fast(spec, kernels)
    assert float(o_ref["metrics"]["drop_frac_recv"]) > 0
    assert torch.allclose(t_fast, t_ref, rtol=1e-6, atol=1e-6)
    for name, g in g_ref.items():
        assert torch.allclose(g_fast[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("seq, window", [(384, 130), (256, 128), (200, 64), (256, None)])
def test_flex_window_block_mask_gives_the_dense_masks_attention(seq, window):
    """FlexAttention with window_block_mask (the GPU's windowed attention) attends exactly where
    model.attention_mask allows: its output equals SDPA's with the dense mask (here in eager fp32
    on the CPU, which has no FlexAttention backward; tests/engines/test_gpu_bf16.py checks the
    gradients on a GPU), with windows that skip whole blocks, end mid-block and on a boundary."""
    from engines.torch.fast import _sdpa, window_block_mask
    from engines.torch.model import attention_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, seq, 16, generator=g) for n in (4, 1, 1))
    o_flex = _sdpa(q, k, v, window_block_mask(seq, window, "cpu"), gqa=True)
    o_dense = _sdpa(q, k, v, attention_mask(seq, window, "cpu"), gqa=True)
    o_causal = _sdpa(q, k, v, None, gqa=True)
    assert torch.allclose(o_flex, o_dense, rtol=1e-5, atol=1e-5)
    assert torch.allclose(o_flex, o_causal, rtol=1e-5, atol=1e-5) == (window is None)  # the window cuts


def test_the_cpu_fast_path_keeps_the_dense_window_mask():
    spec = micro_spec()
    assert spec.model.attention_window is not None and spec.model.attention_window < spec.data.seq_len
    model = MoETransformer(spec.model)
    _, _, mask = FastLoss(model, torch.device("cpu")).tables(spec.data.seq_len, spec.model, "cpu")
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool


def test_eval_on_the_fast_path_scores_each_batch_as_the_reference_forward():
    """TorchStep.eval_losses on the fast path (rows in training-batch forwards, the last filled up
    with copies) gives each eval batch the mean CE the reference forward gives it."""
    spec = micro_spec()
    step = TorchStep(spec, torch.device("cpu"))
    step.init_fresh()
    stream = TokenStream.from_spec(spec)
    plan = stream.eval_plan(None)[:5]
    batches = [stream.eval_batch(src, rows, spec.data.seq_len) for src, rows in plan]
    batches[-1] = batches[-1][:3]  # a short batch: the last forward is filled up
    reference = step.eval_losses(batches)
    fast = fast_eval_losses(FastLoss(step.model, torch.device("cpu")), step.model, batches,
                            spec.data.batch_size, torch.device("cpu"))
    assert len(fast) == len(batches)
    assert fast == pytest.approx(reference, rel=1e-5)
    assert len(set(round(v, 6) for v in fast)) > 1  # the batches differ, so a mix-up would show
