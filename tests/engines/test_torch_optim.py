"""The checkpoint's AdamW state is the documented m / v / step: an update from a loaded state is
the textbook AdamW formula (what optax.adamw computes too), so either engine can resume it."""

import numpy as np
import torch

from engines.data import TokenStream
from engines.torch.master import build_optimizer
from engines.torch.step import optimizer_from_numpy, optimizer_to_numpy
from engines.torch.forward import Forward
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec


def test_update_from_a_saved_state_is_the_adamw_formula():
    spec = micro_spec(**{"optim.weight_decay": 0.1})
    stream = TokenStream.from_spec(spec)
    o, lr = spec.optim, 1e-3
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, 0))
    opt = build_optimizer(model, spec.optim)
    for step in range(3):
        for g in opt.param_groups:
            g["lr"] = lr
        Forward(torch.device("cpu"))(model, torch.from_numpy(stream.batch(step)).long(), o)[0].backward()
        opt.step()
        opt.zero_grad()
    params, state = model.to_numpy(), optimizer_to_numpy(model, opt)
    assert int(state["step"]) == 3

    fresh = MoETransformer(spec.model)
    fresh.load_numpy(params)
    opt2 = build_optimizer(fresh, spec.optim)
    optimizer_from_numpy(fresh, opt2, state)
    for g in opt2.param_groups:
        g["lr"] = lr
    Forward(torch.device("cpu"))(fresh, torch.from_numpy(stream.batch(3)).long(), o)[0].backward()
    grads = {k: p.grad.numpy().astype(np.float64) for k, p in fresh.named_parameters()}
    opt2.step()
    after = fresh.to_numpy()

    t = 4
    for k, g in grads.items():
        p = params[k].astype(np.float64)
        m = o.beta1 * state[f"m/{k}"] + (1 - o.beta1) * g
        v = o.beta2 * state[f"v/{k}"] + (1 - o.beta2) * g * g
        wd = o.weight_decay if p.ndim >= 2 else 0.0
        want = p * (1 - lr * wd) - lr * (m / (1 - o.beta1**t)) / (np.sqrt(v / (1 - o.beta2**t)) + o.eps)
        np.testing.assert_allclose(after[k], want, rtol=1e-5, atol=1e-7, err_msg=k)
    assert int(optimizer_to_numpy(fresh, opt2)["step"]) == 4


def test_a_non_finite_step_changes_neither_weights_moments_step_count_nor_router_biases():
    from engines.torch.step import finish_step, launch_step, make_loss_fn

    spec = micro_spec(**{"model.router_bias_balancing": True, "model.router_bias_rate": 0.01})
    stream = TokenStream.from_spec(spec)
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, 0))
    opt = build_optimizer(model, spec.optim)
    loss_fn = make_loss_fn(model, torch.device("cpu"))
    x = torch.from_numpy(stream.batch(0)).long()
    assert finish_step(model, opt, *launch_step(model, loss_fn, x, spec, opt), spec)[1]
    before = {k: v.copy() for k, v in {**model.to_numpy(), **optimizer_to_numpy(model, opt)}.items()}
    vals, out = launch_step(model, loss_fn, torch.from_numpy(stream.batch(1)).long(), spec, opt)
    vals[0] = float("nan")  # the loss as a diverged step reports it
    out["load_LE"] = out["load_LE"] * float("nan")
    assert not finish_step(model, opt, vals, out, spec)[1]
    after = {**model.to_numpy(), **optimizer_to_numpy(model, opt)}
    assert int(after["step"]) == 1
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)
