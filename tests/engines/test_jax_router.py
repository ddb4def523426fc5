"""The router's gate selection (moe.pick): the values and the gradient of take_along_axis, without
its scatter-add transpose."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from engines.jax.moe import pick


def _scores_and_choice(T=64, E=16, K=4, seed=0):
    scores_TE = jax.nn.softmax(jax.random.normal(jax.random.key(seed), (T, E)), axis=-1)
    _, expert_TK = lax.top_k(scores_TE, K)
    return scores_TE, expert_TK


def test_pick_selects_the_same_values_bitwise():
    scores_TE, expert_TK = _scores_and_choice()
    want = jnp.take_along_axis(scores_TE, expert_TK, axis=-1)
    np.testing.assert_array_equal(np.asarray(pick(scores_TE, expert_TK)), np.asarray(want))


def test_pick_gradient_equals_take_along_axis_gradient_bitwise():
    scores_TE, expert_TK = _scores_and_choice(seed=1)
    w_TK = jax.random.normal(jax.random.key(2), expert_TK.shape)

    def loss(fn):
        return lambda s: jnp.sum(fn(s) * w_TK)

    got = jax.grad(loss(lambda s: pick(s, expert_TK)))(scores_TE)
    want = jax.grad(loss(lambda s: jnp.take_along_axis(s, expert_TK, axis=-1)))(scores_TE)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(jnp.sum(got != 0)) == expert_TK.size  # only the chosen experts get a gradient


def test_pick_transpose_has_no_scatter():
    scores_TE, expert_TK = _scores_and_choice()
    hlo = jax.jit(jax.grad(lambda s: jnp.sum(pick(s, expert_TK)))).lower(scores_TE).as_text()
    assert "scatter" not in hlo
