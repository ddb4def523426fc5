"""MasterAdamW (engines/torch/master.py): AdamW on fp32 masters that writes the working copies the
forward reads. On the CPU, with fp32 working copies, it must train exactly like torch's AdamW
+ clip_grad_norm_ on the same forward; with bf16 copies, the copies are the masters rounded; and a
run resumed from its state continues as if never stopped."""

import numpy as np
import pytest
import torch

from engines.data import TokenStream
from engines.options import EngineOptions
from engines.torch.step import (
    finish_step,
    launch_step,
    make_loss_fn,
    optimizer_from_numpy,
    optimizer_to_numpy,
)
from engines.torch.forward import Forward, working_dtype
from engines.torch.master import MasterAdamW, build_optimizer, foreach_norms, weight_layout
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec

# latent + shared experts: every kind of working copy of weight_layout is exercised; a clip far
# below the gradient norm keeps clipping active at every step
SPEC = micro_spec(**{"optim.grad_clip": 0.05, "optim.weight_decay": 0.1})


def _model():
    model = MoETransformer(SPEC.model)
    model.load_numpy(init_params(SPEC.model, SPEC.seed))
    return model


def _master(model, dtype=torch.float32, moments=torch.float32):
    plain = build_optimizer(model, SPEC.optim)
    return MasterAdamW(model, plain.param_groups, lr=SPEC.optim.peak_lr,
                       betas=(SPEC.optim.beta1, SPEC.optim.beta2), eps=SPEC.optim.eps, dtype=dtype,
                       moments=moments)


def _train(model, opt, loss_fn, steps, start=0):
    stream = TokenStream.from_spec(SPEC)
    norms = []
    for s in range(start, start + steps):
        x = torch.from_numpy(stream.batch(s)).long()
        vals, out = launch_step(model, loss_fn, x, SPEC, opt)
        m, finite = finish_step(model, opt, vals, out, SPEC)
        assert finite
        norms.append(m["grad_norm"])
    return norms


def test_fp32_working_copies_train_exactly_like_adamw_with_clipping():
    ref = _model()
    ref_opt = build_optimizer(ref, SPEC.optim)
    ref_norms = _train(ref, ref_opt, Forward(torch.device("cpu")), 5)
    model = _model()
    opt = _master(model)
    norms = _train(model, opt, make_loss_fn(model, torch.device("cpu"), opt), 5)
    assert min(ref_norms) > 10 * SPEC.optim.grad_clip  # clipping was active throughout
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-7, msg=name)
    for name, leaf in opt.working().items():  # the copies hold the updated masters
        torch.testing.assert_close(leaf.detach(), torch.cat(weight_layout(model)[name], -1).detach(),
                                   rtol=0, atol=0, msg=name)


def test_norms_of_a_mixed_dtype_list_come_back_in_its_order():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g).to(dt) for n, dt in
          [(5, torch.bfloat16), (7, torch.float32), (3, torch.bfloat16), (4, torch.float16), (6, torch.float32)]]
    got = foreach_norms(ts)
    assert [n.dtype for n in got] == [torch.float32] * 5
    torch.testing.assert_close(torch.stack(got), torch.stack([t.double().norm().float() for t in ts]))


def test_matmul_gradients_land_on_the_working_copies():
    model = _model()
    opt = _master(model)
    total, _ = make_loss_fn(model, torch.device("cpu"), opt)(
        model, torch.from_numpy(TokenStream.from_spec(SPEC).batch(0)).long(), SPEC.optim)
    total.backward()
    in_copies = {id(p) for parts in weight_layout(model).values() for p in parts}
    for name, p in model.named_parameters():
        assert (p.grad is None) == (id(p) in in_copies), name
    assert all(leaf.grad is not None and float(leaf.grad.norm()) > 0 for leaf in opt.working().values())


def test_bf16_working_copies_are_the_masters_rounded():
    model = _model()
    opt = _master(model, torch.bfloat16)
    _train(model, opt, make_loss_fn(model, torch.device("cpu"), opt), 2)
    layout = weight_layout(model)
    for name, leaf in opt.working().items():
        assert leaf.dtype == torch.bfloat16
        want = torch.cat(layout[name], -1).detach().to(torch.bfloat16)
        assert torch.equal(leaf.detach(), want), name
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_resumed_from_saved_state_continues_exactly():
    split = 2
    whole = _model()
    whole_opt = _master(whole)
    _train(whole, whole_opt, make_loss_fn(whole, torch.device("cpu"), whole_opt), 4)

    first = _model()
    first_opt = _master(first)
    _train(first, first_opt, make_loss_fn(first, torch.device("cpu"), first_opt), split)
    params, state = first.to_numpy(), optimizer_to_numpy(first, first_opt)

    resumed = MoETransformer(SPEC.model)
    opt = _master(resumed)  # built before the weights are loaded, as the engine does
    resumed.load_numpy(params)
    optimizer_from_numpy(resumed, opt, state)
    _train(resumed, opt, make_loss_fn(resumed, torch.device("cpu"), opt), 4 - split, start=split)
    for (name, p), q in zip(resumed.named_parameters(), whole.parameters()):
        assert torch.equal(p, q), name


def test_bf16_moments_are_the_fp32_update_rounded_and_stay_bf16_across_a_resume():
    runs = []
    for moments in (torch.float32, torch.bfloat16):
        model = _model()
        opt = _master(model, moments=moments)
        _train(model, opt, make_loss_fn(model, torch.device("cpu"), opt), 1)
        runs.append((model, opt))
    (ref, ref_opt), (got, got_opt) = runs
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):  # from zero moments: one rounding of the same value
            assert got_opt.state[p][key].dtype == torch.bfloat16, name
            assert torch.equal(got_opt.state[p][key], ref_opt.state[q][key].to(torch.bfloat16)), (name, key)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)  # the update read fp32 moments
    state = optimizer_to_numpy(got, got_opt)
    assert state[f"v/{next(iter(dict(got.named_parameters())))}"].dtype == np.float32
    resumed = MoETransformer(SPEC.model)
    opt = _master(resumed, moments=torch.bfloat16)
    resumed.load_numpy(got.to_numpy())
    optimizer_from_numpy(resumed, opt, state)
    for p, q in zip(resumed.parameters(), got.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], got_opt.state[q][key])  # bf16 again, the same values


def test_a_spec_with_bf16_moments_trains_with_them_and_a_trainer_that_cannot_refuses():
    spec = SPEC.replace(**{"optim.moments": "bf16"})
    model = _model()
    working = working_dtype(spec, torch.device("cpu"), EngineOptions())  # on the CPU too (fp32 working copies)
    opt = build_optimizer(model, spec.optim, working=working)
    assert isinstance(opt, MasterAdamW) and opt.dtype == torch.float32
    norms = _train(model, opt, make_loss_fn(model, torch.device("cpu"), opt), 2)
    assert np.isfinite(norms).all()
    assert {st["exp_avg"].dtype for st in opt.state.values()} == {torch.bfloat16}
    assert {st["exp_avg_sq"].dtype for st in opt.state.values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="optim.moments bf16 needs the torch engine's MasterAdamW"):
        build_optimizer(_model(), spec.optim)  # (torch's AdamW, as the expert-parallel trainer's)


def test_bf16_moments_refuse_a_beta2_whose_updates_round_away():
    model = _model()
    for beta2, refused in ((0.999, True), (0.95, False)):
        groups = [{"params": list(model.parameters())}]  # (a group takes the defaults in place)
        if refused:
            with pytest.raises(ValueError, match="beta2 <= 0.99"):
                MasterAdamW(model, groups, lr=1e-3, betas=(0.9, beta2), eps=1e-8, moments=torch.bfloat16)
        else:
            MasterAdamW(model, groups, lr=1e-3, betas=(0.9, beta2), eps=1e-8, moments=torch.bfloat16)


def test_a_non_finite_step_changes_nothing():
    model = _model()
    opt = _master(model, torch.bfloat16)
    loss_fn = make_loss_fn(model, torch.device("cpu"), opt)
    _train(model, opt, loss_fn, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    copies = {n: t.detach().clone() for n, t in opt.working().items()}
    x = torch.from_numpy(TokenStream.from_spec(SPEC).batch(1)).long()
    vals, out = launch_step(model, loss_fn, x, SPEC, opt)
    vals[0] = float("nan")  # the loss as a diverged step would report it
    m, finite = finish_step(model, opt, vals, out, SPEC)
    assert not finite
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert torch.equal(opt.state[p]["exp_avg"], moments[id(p)]), n
        assert int(opt.state[p]["step"]) == 1, n
    for n, t in opt.working().items():
        assert torch.equal(t.detach(), copies[n]), n


@pytest.mark.parametrize("master, seconds, on", [
    (None, 60.0, False),      # a short run: the compile would not pay
    (None, 3600.0, True),     # an hour: it does
    (None, None, True),       # duration unknown
    (True, 60.0, True),       # forced on
    (False, 3600.0, False),   # forced off
])
def test_with_the_compiled_update_working_copies_are_kept_for_long_runs_unless_forced(master, seconds, on):
    from engines.options import EngineOptions, TorchKernels
    from engines.torch.forward import working_copies_enabled

    options = EngineOptions(torch_master=master, torch_kernels=TorchKernels(adamw="compile"))
    assert working_copies_enabled(torch.device("cuda"), options, seconds) is on
    assert working_copies_enabled(torch.device("cpu"), options, seconds) is False  # a GPU-only path


def test_the_triton_update_keeps_working_copies_for_short_runs():
    pytest.importorskip("triton")
    from engines.options import EngineOptions, TorchKernels
    from engines.torch.forward import working_copies_enabled

    assert working_copies_enabled(torch.device("cuda"), EngineOptions(), 60.0) is True  # nothing to compile
    compiled = EngineOptions(torch_kernels=TorchKernels(adamw="compile"))
    assert working_copies_enabled(torch.device("cuda"), compiled, 60.0) is False
