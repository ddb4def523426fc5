"""On a CUDA GPU, the torch engine's bf16 forward (compiled, grouped GEMM, the GPU kernels) agrees
with the fp32 forward of the reference kernels within bf16 tolerance: the loss, every gradient's direction and size, and the loss
after one optimizer step. Skipped without CUDA."""

import pytest
import torch

from engines.data import TokenStream
from engines.options import EngineOptions, TorchKernels
from engines.torch.forward import Forward
from engines.torch.experts import kernels_here
from engines.torch.master import build_optimizer
from engines.torch.step import (
    HostCopy,
    finish_step,
    launch_step,
    make_loss_fn,
    queue_update,
    read_step,
    to_device,
)
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = {"model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 4, "model.head_dim": 64,
         "model.n_routed_experts": 8, "model.top_k": 2, "model.expert_hidden": 128, "model.latent_dim": None,
         "model.n_shared_experts": 0, "model.attention_window": None, "model.ep_size": 1,
         "data.seq_len": 256, "data.batch_size": 4, "data.total_tokens": 256 * 4 * 10}


def _setup(dispatch, **changes):
    spec = micro_spec(**{**SHAPE, **changes, "model.dispatch": dispatch})
    dev = torch.device("cuda")
    model = MoETransformer(spec.model).to(dev)
    model.load_numpy(init_params(spec.model, spec.seed))
    x = torch.from_numpy(TokenStream.from_spec(spec).batch(0)).to(dev, dtype=torch.long)
    return spec, model, x


def fp32_loss():
    """The reference kernels' forward in fp32 on the GPU: the yardstick of the bf16 paths."""
    return Forward(torch.device("cuda"), TorchKernels.reference(), cdt=torch.float32)


def _grads(model, fn, x, optim):
    model.zero_grad(set_to_none=True)
    total, _ = fn(model, x, optim)
    total.backward()
    return float(total), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dispatch, experts, router, kernels, rope", [
    ("dropless", "grouped", "fp32", "inductor", "bhsq"), ("capacity", "grouped", "fp32", "inductor", "bhsq"),
    ("dropless", "grouped", "tf32", "triton", "bhsq"), ("dropless", "grouped", "tf32", "triton", "bshq"),
    ("dropless", "fused", "tf32", "inductor", "bhsq"), ("dropless", "fused-gather", "fp32", "inductor", "bhsq")])
def test_bf16_fast_step_matches_the_fp32_path(dispatch, experts, router, kernels, rope):
    from engines.options import EngineOptions, TorchKernels

    # kernels: the SwiGLU backward and the head's losses by Inductor or by Triton kernels;
    # rope: RoPE's layout
    options = EngineOptions(torch_kernels=TorchKernels(experts=experts, router=router, swiglu=kernels, xent=kernels,
                                                       rope_layout=rope))
    spec, model, x = _setup(dispatch)
    loss32, g32 = _grads(model, fp32_loss(), x, spec.optim)  # fp32 throughout
    fast = make_loss_fn(model, x.device, options=options)
    loss16, g16 = _grads(model, fast, x, spec.optim)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    for name, g in g32.items():
        if float(g.norm()) < 1e-8:
            continue
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), g16[name].flatten(), dim=0))
        assert cos > 0.98, (name, cos)
        assert abs(float(g16[name].norm()) / float(g.norm()) - 1) < 0.05, name

    # one optimizer step each from the same weights: the losses after it agree too
    # (the fast step with the engine's optimizer: MasterAdamW and its bf16 working copies)
    after = []
    for fast_step in (False, True):
        spec, model, x = _setup(dispatch)
        opt = build_optimizer(model, spec.optim, working=torch.bfloat16 if fast_step else None,
                              kernel=kernels_here(options.torch_kernels).adamw)
        fn = make_loss_fn(model, x.device, opt, options) if fast_step else fp32_loss()
        vals, out = launch_step(model, fn, x, spec, opt)
        finish_step(model, opt, vals, out, spec)
        with torch.no_grad():
            after.append(float(fp32_loss()(model, x, spec.optim)[0]))
    assert after[1] < loss32 and after[0] < loss32
    assert abs(after[1] - after[0]) <= 1e-2 * abs(after[0])


def test_a_host_copy_is_read_without_waiting_for_kernels_queued_after_it():
    t = to_device(TokenStream.from_spec(micro_spec(**SHAPE)).batch(0), torch.device("cuda"))
    pending = HostCopy(t[:, :8] * 2)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued behind the copy
    got = pending.tolist()
    assert not torch.cuda.current_stream().query()  # the read came back while the sleep still ran
    assert got == (t[:, :8] * 2).tolist()


@pytest.mark.parametrize("working", [True, False], ids=["MasterAdamW", "GuardedAdamW"])
def test_a_fast_step_is_queued_without_a_host_sync(working):
    spec, model, x = _setup("dropless")
    opt = build_optimizer(model, spec.optim, working=torch.bfloat16 if working else None,
                          kernel=kernels_here(EngineOptions().torch_kernels).adamw)
    fn = make_loss_fn(model, x.device, opt if working else None)
    stream = TokenStream.from_spec(spec)
    assert read_step(opt, queue_update(model, opt, *launch_step(model, fn, x, spec, opt), spec))[1]  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        pending = queue_update(model, opt, *launch_step(model, fn, to_device(stream.batch(1), x.device), spec, opt),
                               spec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert read_step(opt, pending)[1]


@pytest.mark.parametrize("compile_mode", ["block-cudagraphs", "none"])
def test_windowed_attention_through_flex_matches_the_fp32_path(compile_mode):
    """A sliding window on the GPU runs through FlexAttention's block mask (window_attention
    "flex", compiled inside the blocks or on its own): loss and gradients agree with the fp32
    reference's dense-mask attention, as closely as SDPA with the dense mask does in bf16."""
    from engines.options import EngineOptions, TorchKernels
    from engines.torch.forward import BlockMask

    window = {"model.attention_window": 200, "model.n_kv_heads": 1, "data.seq_len": 512,
              "data.total_tokens": 512 * 4 * 10}
    spec, model, x = _setup("dropless", **window)
    dev = x.device
    loss32, g32 = _grads(model, fp32_loss(), x, spec.optim)
    got = {}
    for kind in ("flex", "mask"):
        options = EngineOptions(torch_kernels=TorchKernels(window_attention=kind, compile=compile_mode))
        fast = make_loss_fn(model, x.device, options=options)
        assert isinstance(fast.tables(512, spec.model, dev)[2], BlockMask) == (kind == "flex")
        got[kind] = _grads(model, fast, x, spec.optim)
    for kind, (loss16, g16) in got.items():
        assert abs(loss16 - loss32) <= 1e-2 * abs(loss32), kind
        for name, g in g32.items():
            if float(g.norm()) < 1e-8:
                continue
            cos = float(torch.nn.functional.cosine_similarity(g.flatten(), g16[name].flatten(), dim=0))
            assert cos > 0.98, (kind, name, cos)
    assert abs(got["flex"][0] - got["mask"][0]) <= 2e-3 * abs(loss32)
