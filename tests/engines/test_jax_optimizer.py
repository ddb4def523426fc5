"""engines/jax/train.make_optimizer: with optim.moments bf16 both Adam moments are stored in bf16,
rounded from the fp32 update that the parameters receive unrounded; checkpoints hold them as fp32
and a load rounds them back to the same values."""

import jax
import jax.numpy as jnp
import numpy as np

from engines.jax.engine import state_from_arrays, state_to_arrays
from engines.jax.model import ModelConfig, init_params
from engines.jax.train import init_state, make_optimizer
from ladder.presets import micro_spec

SPEC = micro_spec(engine="jax", **{"optim.moments": "bf16"})


def _adam(state):
    return next(s for s in state if hasattr(s, "nu"))


def _grads(params, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(params))
    return {k: jax.random.normal(key, p.shape, jnp.float32) for key, (k, p) in zip(keys, sorted(params.items()))}


def test_bf16_moments_are_the_fp32_update_rounded():
    params, _ = init_params(ModelConfig.from_spec(SPEC.model), SPEC.seed)
    ref_tx = make_optimizer(SPEC.optim.model_copy(update={"moments": "fp32"}), params)
    tx = make_optimizer(SPEC.optim, params)
    ref_state, state = ref_tx.init(params), tx.init(params)
    assert all(v.dtype == jnp.bfloat16 for v in (*_adam(state).mu.values(), *_adam(state).nu.values()))
    g = _grads(params, 0)
    ref_out, ref_state = ref_tx.update(g, ref_state, params)
    out, state = tx.update(g, state, params)
    for k in params:  # from zero moments: the same fp32 update, and one rounding of the same moments
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref_out[k]))
        for key in ("mu", "nu"):
            got, want = getattr(_adam(state), key)[k], getattr(_adam(ref_state), key)[k]
            assert got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
    # the second update reads the rounded moments in fp32: per tensor, within bf16's rounding of the
    # fp32 run's (single elements differ more where b1 * m and the new gradient nearly cancel)
    g = _grads(params, 1)
    ref_out, _ = ref_tx.update(g, ref_state, params)
    out, _ = tx.update(g, state, params)
    for k in params:
        diff = np.linalg.norm(np.asarray(out[k]) - np.asarray(ref_out[k]))
        assert 0 < diff <= 2**-8 * np.linalg.norm(np.asarray(ref_out[k])), k


def test_bf16_moments_go_through_a_checkpoint_unchanged():
    cfg = ModelConfig.from_spec(SPEC.model)
    params, buffers = init_params(cfg, SPEC.seed)
    tx = make_optimizer(SPEC.optim, params)
    _, opt_state = tx.update(_grads(params, 2), tx.init(params), params)
    model, opt = state_to_arrays(init_state(cfg, params, buffers, tx, opt_state))
    assert all(v.dtype == np.float32 for k, v in opt.items() if k != "step")
    back = state_from_arrays(cfg, tx, model, opt, "test")
    for key in ("mu", "nu"):
        for k, v in getattr(_adam(back.opt_state), key).items():
            assert v.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(getattr(_adam(opt_state), key)[k], np.float32))
