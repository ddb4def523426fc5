"""bf16 working copies in the JAX train state (engines/jax/train.py): with them, the jitted step
takes the steps it takes without them, up to the rounding of each weight gradient to bf16 (without
copies XLA may fold the upcast into the product and skip that rounding); the copies stay the
masters rounded; a checkpoint round trip rebuilds them. Run on the CPU with a bf16 compute dtype."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines.data import TokenStream
from engines.jax.engine import compiled_steps, state_from_arrays, state_to_arrays
from engines.jax.model import ModelConfig, init_params
from engines.jax.train import make_state
from ladder.presets import micro_spec

SPEC = micro_spec(engine="jax", **{"model.dispatch": "dropless"})


def _cfg():
    return dataclasses.replace(ModelConfig.from_spec(SPEC.model), compute_dtype="bfloat16")


def _run(monkeypatch, working: bool, steps: int = 3):
    monkeypatch.setenv("MOE_LADDER_JAX_WORKING", "1" if working else "0")
    cfg = _cfg()
    step, _, tx = compiled_steps(cfg, SPEC.optim, SPEC.model.router_bias_rate, None)
    params, buffers = init_params(cfg, SPEC.seed)
    state = make_state(params, buffers, tx.init(params), cfg)
    stream = TokenStream.from_spec(SPEC)
    norms = []
    for s in range(steps):
        state, m = step(state, jnp.asarray(stream.batch(s)), jnp.float32(SPEC.optim.peak_lr))
        norms.append(float(m["grad_norm"]))
    return state, norms, tx, cfg


def test_working_copies_take_the_same_steps(monkeypatch):
    plain, plain_norms, _, _ = _run(monkeypatch, working=False)
    work, norms, _, _ = _run(monkeypatch, working=True)
    assert not plain.working and work.working
    assert "lm_head" in work.working and "blocks.0.moe.experts.w_gate" in work.working
    assert "embed.weight" not in work.working and "blocks.0.moe.router" not in work.working
    np.testing.assert_allclose(norms, plain_norms, rtol=1e-4)
    for k, v in plain.params.items():  # updates are ~lr = 3e-3 a step; bf16 gradients move them ~1e-5
        np.testing.assert_allclose(work.params[k], v, rtol=0, atol=1e-4, err_msg=k)


def test_working_copies_are_the_masters_rounded_and_survive_a_checkpoint(monkeypatch):
    state, _, tx, cfg = _run(monkeypatch, working=True, steps=2)
    for k, w in state.working.items():
        assert w.dtype == jnp.bfloat16
        assert bool(jnp.all(w == state.params[k].astype(jnp.bfloat16))), k
    model, opt = state_to_arrays(state)
    back = state_from_arrays(cfg, tx, model, opt, "round trip")
    assert set(back.working) == set(state.working)
    for k, w in state.working.items():
        assert bool(jnp.all(back.working[k] == w)), k


@pytest.mark.parametrize("env", ["0", None])
def test_off_unless_asked(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("MOE_LADDER_JAX_WORKING", raising=False)
    else:
        monkeypatch.setenv("MOE_LADDER_JAX_WORKING", env)
    params, buffers = init_params(_cfg(), SPEC.seed)
    assert make_state(params, buffers, (), _cfg()).working == {}
    jax.clear_caches()
