"""engines/jax/train working copies: in a 16-bit compute dtype the step keeps each matmul weight's
master rounded to that dtype and trains as casting every master in every step does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from engines.data import TokenStream
from engines.jax.engine import compiled_steps, configure_jax
from engines.jax.model import ModelConfig, init_params
from engines.jax.train import init_state, working_names
from engines.options import JaxKernels
from ladder.presets import micro_spec

SPEC = micro_spec(engine="jax", **{"optim.peak_lr": 1e-2})


def _cfg(weights: str, dtype: str = "bfloat16") -> ModelConfig:
    configure_jax()
    cfg = ModelConfig.from_spec(SPEC.model)
    return dataclasses.replace(cfg, compute_dtype=dtype, kernels=JaxKernels(weights=weights))


def _train(cfg: ModelConfig, steps: int = 3):
    step_fn, _, tx = compiled_steps(cfg, SPEC.optim, SPEC.model.router_bias_rate, None)
    params, buffers = init_params(cfg, SPEC.seed)
    state = init_state(cfg, params, buffers, tx)
    stream = TokenStream.from_spec(SPEC)
    rows = []
    for s in range(steps):
        state, m = step_fn(state, jnp.asarray(stream.batch(s)), jnp.float32(SPEC.optim.peak_lr))
        rows.append({k: float(v) for k, v in jax.device_get(m).items()})
    return state, rows


def test_working_copies_are_the_matmul_weights_and_none_in_fp32():
    cfg = _cfg("working")
    params, _ = init_params(cfg, SPEC.seed)
    names = set(working_names(cfg, params))
    assert "lm_head" in names and "blocks.0.attn.wq" in names and "blocks.1.moe.experts.w_down" in names
    assert "embed.weight" not in names and "blocks.0.moe.router" not in names
    assert not any(k.endswith("norm.weight") for k in names)
    assert working_names(_cfg("working", "float32"), params) == []
    assert working_names(_cfg("cast"), params) == []


def test_the_step_writes_each_working_copy_as_its_updated_master_rounded():
    state, _ = _train(_cfg("working"), steps=2)
    assert set(state.working) == set(working_names(_cfg("working"), state.params))
    for k, w in state.working.items():
        assert w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(w), np.asarray(state.params[k].astype(jnp.bfloat16)))


def test_working_copies_train_as_casting_every_master_does():
    got_state, got = _train(_cfg("working"))
    want_state, want = _train(_cfg("cast"))
    assert got[0]["loss"] == want[0]["loss"]  # the same bf16 weights in the first forward
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-3 * w["loss"]
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-2 * w["grad_norm"]
    for k, v in want_state.params.items():
        np.testing.assert_allclose(np.asarray(got_state.params[k]), np.asarray(v), rtol=0, atol=2e-3, err_msg=k)
