"""Pieces of the JAX model that the engine tests do not pin down on the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines.jax.model import ModelConfig, attend_fused, attend_masked, attention_mask, forward, init_params
from engines.jax.moe import make_moe_fn
from ladder.presets import micro_spec

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.mark.parametrize("window", [None, 1, 5, 16])
def test_fused_attention_keeps_the_same_causal_window_as_the_mask(window):
    # the GPU path (fused kernel, window given as keys to the left) and the CPU path (explicit mask)
    rng = np.random.default_rng(0)
    B, S, H, G, Q = 2, 16, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, n, Q)).astype(np.float32)) for n in (H, G, G))
    mask = jnp.asarray(attention_mask(S, window))
    ref = attend_masked(q, k, v, mask, jnp.float32)
    np.testing.assert_allclose(np.asarray(attend_fused(q, k, v, window, jnp.float32)), np.asarray(ref),
                               rtol=1e-5, atol=1e-5)


def test_bf16_compute_stays_close_to_fp32():
    spec = micro_spec(**{"model.dispatch": "capacity", "model.n_layers": 1})
    cfg32 = ModelConfig.from_spec(spec.model)
    cfg16 = dataclasses.replace(cfg32, compute_dtype="bfloat16")
    params, buffers = init_params(cfg32, 0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(8, 64)), jnp.int32)
    out = {}
    for name, cfg in (("fp32", cfg32), ("bf16", cfg16)):
        fn = jax.jit(lambda p, b, t, cfg=cfg: forward(p, b, t, cfg, make_moe_fn(cfg, 64)))
        logits, _ = fn(params, buffers, tokens)
        assert logits.dtype == cfg.dtype  # the fused losses read the head's product as it is
        out[name] = np.asarray(logits.astype(jnp.float32))
    assert np.abs(out["bf16"] - out["fp32"]).max() < 0.05 * np.abs(out["fp32"]).max()


def test_bf16_matmul_gradients_are_16_bit_products():
    """In bf16 compute every product of the backward reads 16-bit operands: an fp32 operand would
    make XLA run the gradient GEMMs in TF32, about 3x slower on a GPU."""
    import jax
    import jax.numpy as jnp

    from engines.jax.model import einsum, mm

    x, w = jnp.ones((8, 16), jnp.float32), jnp.ones((16, 4), jnp.float32)
    w3 = jnp.ones((2, 16, 4), jnp.float32)

    def loss(x, w, w3):
        return jnp.sum(mm(x, w, jnp.bfloat16) ** 2) + jnp.sum(einsum("td,edf->etf", x, w3, jnp.bfloat16) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, w, w3).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 6  # two forward products, four gradient products
    for e in dots:
        assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e
