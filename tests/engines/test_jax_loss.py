"""engines/jax/loss.head_losses: the custom VJP gives autodiff's losses and logit gradients, in fp32
and from 16-bit logits (where its gradient stays 16-bit)."""

import jax
import jax.numpy as jnp
import numpy as np

from engines.jax.loss import head_losses, head_losses_autodiff

Z = 1e-3  # a z-loss weight, so both cotangents reach the backward


def _data(dtype):
    logits_TV = (3.0 * jax.random.normal(jax.random.PRNGKey(0), (96, 53))).astype(dtype)
    targets_T = jax.random.randint(jax.random.PRNGKey(1), (96,), 0, 53)
    return logits_TV, targets_T


def _total(losses, targets_T):
    def total(logits_TV):
        ce, z = losses(logits_TV, targets_T)
        return ce + Z * z

    return jax.jit(jax.value_and_grad(total))


def test_fused_losses_and_gradient_are_autodiffs_in_fp32():
    logits_TV, targets_T = _data(jnp.float32)
    got, got_g = _total(head_losses, targets_T)(logits_TV)
    want, want_g = _total(head_losses_autodiff, targets_T)(logits_TV)
    assert float(got) == float(want)
    np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-5, atol=1e-9)


def test_fused_gradient_from_bf16_logits_is_bf16_and_autodiffs():
    logits_TV, targets_T = _data(jnp.bfloat16)
    got, got_g = _total(head_losses, targets_T)(logits_TV)
    want, want_g = _total(head_losses_autodiff, targets_T)(logits_TV)
    assert got_g.dtype == jnp.bfloat16 and float(got) == float(want)
    # both form the gradient in fp32 and round it to bf16 once: within one bf16 step of each other
    diff = np.abs(np.asarray(got_g, np.float32) - np.asarray(want_g, np.float32))
    assert np.all(diff <= 2**-8 * np.abs(np.asarray(want_g, np.float32)) + 1e-9)

