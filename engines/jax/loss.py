"""The output head's losses: mean token cross-entropy and the logit z-loss, one pass each way.

    ce, z = head_losses(logits_TV, targets_T)   # logits in the compute dtype (bf16 on a GPU)

Forward: the log-partition lse_T in fp32, the logits upcast inside the reduction. Backward (a
custom VJP): the logits' gradient

    dlogits_TV = softmax_TV * (g_ce + 2 g_z lse_T) / T - onehot_TV * g_ce / T

formed in fp32 from the stored 16-bit logits and lse_T, written in the logits' dtype. Autodiff of
the same loss over fp32 logits stores the [T, V] logits twice (16-bit and fp32) and writes an fp32
gradient that a convert then halves; here no fp32 [T, V] array is ever stored. In fp32 (the CPU)
the result is autodiff's to rounding.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _lse(logits_TV: jax.Array) -> jax.Array:
    return jax.nn.logsumexp(logits_TV.astype(jnp.float32), axis=-1)


def _losses(logits_TV, targets_T, lse_T):
    tgt_T = jnp.take_along_axis(logits_TV, targets_T[:, None], axis=-1)[:, 0].astype(jnp.float32)
    return jnp.mean(lse_T - tgt_T), jnp.mean(lse_T**2)


@jax.custom_vjp
def head_losses(logits_TV: jax.Array, targets_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean token cross-entropy, mean squared log-partition)."""
    return _losses(logits_TV, targets_T, _lse(logits_TV))


def _fwd(logits_TV, targets_T):
    lse_T = _lse(logits_TV)
    return _losses(logits_TV, targets_T, lse_T), (logits_TV, targets_T, lse_T)


def _bwd(res, g):
    logits_TV, targets_T, lse_T = res
    g_ce, g_z = g
    T, V = logits_TV.shape
    p_TV = jnp.exp(logits_TV.astype(jnp.float32) - lse_T[:, None])
    coef_T = (g_ce + 2.0 * g_z * lse_T) / T
    hit_TV = jax.lax.broadcasted_iota(targets_T.dtype, (T, V), 1) == targets_T[:, None]
    d_TV = p_TV * coef_T[:, None] - jnp.where(hit_TV, g_ce / T, 0.0)
    return d_TV.astype(logits_TV.dtype), None


head_losses.defvjp(_fwd, _bwd)


def head_losses_autodiff(logits_TV: jax.Array, targets_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The same losses by autodiff over fp32 logits (JaxKernels.loss "xla")."""
    logits_TV = logits_TV.astype(jnp.float32)
    return _losses(logits_TV, targets_T, _lse(logits_TV))
