"""The JAX pooled-wave capacity transport against the rules, as engines/dispatch_ref.py writes
them out in plain numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engines.dispatch_ref import capacity_plan
from engines.jax.model import ModelConfig
from engines.jax.moe import capacities, capacity_experts as _capacity_experts, dropless_experts
from ladder.presets import micro_spec

jax.config.update("jax_default_matmul_precision", "highest")
capacity_experts = jax.jit(_capacity_experts, static_argnums=(6, 7))  # compiled: eager is slower here


def _cfg(E=8, K=2, ep=2, waves=1, cf_s=1.0, cf_r=1.0) -> ModelConfig:
    spec = micro_spec(**{"model.n_routed_experts": E, "model.top_k": K, "model.ep_size": ep,
                         "model.n_waves": waves, "model.capacity_factor_send": cf_s,
                         "model.capacity_factor_recv": cf_r, "model.dispatch": "capacity"})
    return ModelConfig.from_spec(spec.model)


def _weights(rng, E, L, F):
    return [jnp.asarray(rng.normal(0, 0.3, s).astype(np.float32)) for s in ((E, L, F), (E, L, F), (E, F, L))]


def _expert_out(x_L, e, wg, wu, wd):
    wg, wu, wd = (np.asarray(a, np.float64) for a in (wg, wu, wd))
    a = x_L @ wg[e]
    return (a / (1.0 + np.exp(-a)) * (x_L @ wu[e])) @ wd[e]


def _expected(x_TL, expert_TK, gate_TK, kept_TK, w):
    y = np.zeros(x_TL.shape, np.float32)
    for t in range(x_TL.shape[0]):
        for j in range(expert_TK.shape[1]):
            if kept_TK[t, j]:
                y[t] += gate_TK[t, j] * _expert_out(x_TL[t], int(expert_TK[t, j]), *w)
    return y


def test_hand_check_all_tokens_to_one_expert():
    # T=8, k=1, E=4, ep=2, W=1, cf 1: C_send = 2, C_recv = 2. Every token picks expert 0: each
    # source sends its first 2 tokens (4 send drops), expert 0 keeps source 0's two (2 recv drops).
    cfg = _cfg(E=4, K=1, ep=2, waves=1)
    assert capacities(cfg, 8) == (2, 2)
    rng = np.random.default_rng(0)
    x_TL = jnp.asarray(rng.normal(size=(8, 16)).astype(np.float32))
    expert_TK = jnp.zeros((8, 1), jnp.int32)
    gate_TK = jnp.ones((8, 1), jnp.float32)
    w = _weights(rng, 4, 16, 8)
    y, n_send, n_recv = capacity_experts(x_TL, expert_TK, gate_TK, *w, cfg, None)
    assert (float(n_send), float(n_recv)) == (4.0, 2.0)
    nonzero = np.abs(np.asarray(y)).sum(axis=1) > 0
    assert nonzero.tolist() == [True, True, False, False, False, False, False, False]


@pytest.mark.parametrize("ep,waves,K,cf_s", [(2, 1, 2, 1.0), (4, 2, 2, 1.5), (4, 3, 1, 2.0), (8, 2, 3, 1.0)])
def test_drops_and_outputs_match_the_rules_on_skewed_routings(ep, waves, K, cf_s):
    E, T, L, F = 8, 64, 16, 8
    cfg = _cfg(E=E, K=K, ep=ep, waves=waves, cf_s=cf_s)
    rng = np.random.default_rng(ep * 10 + waves)
    # skewed: low-numbered experts are popular, so both bounds bite
    p = np.arange(E, 0, -1, dtype=np.float64) ** 2
    expert_TK = np.stack([rng.choice(E, size=K, replace=False, p=p / p.sum()) for _ in range(T)]).astype(np.int32)
    gate_TK = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
    x_TL = rng.normal(size=(T, L)).astype(np.float32)
    w = _weights(rng, E, L, F)
    plan = capacity_plan(expert_TK, E, ep, waves, cf_s, 1.0)
    kept, send_drops, recv_drops = plan.kept_TK, int(plan.send_drop_TK.sum()), int(plan.recv_drop_TK.sum())
    assert send_drops > 0 and recv_drops > 0
    y, n_send, n_recv = capacity_experts(jnp.asarray(x_TL), jnp.asarray(expert_TK), jnp.asarray(gate_TK), *w, cfg, None)
    assert (int(n_send), int(n_recv)) == (send_drops, recv_drops)
    np.testing.assert_allclose(np.asarray(y), _expected(x_TL, expert_TK, gate_TK, kept, w), rtol=1e-5, atol=1e-5)


def test_capacity_equals_dropless_when_the_factors_are_large():
    E, T, K, L, F, ep = 8, 64, 2, 16, 8, 4
    cfg = _cfg(E=E, K=K, ep=ep, waves=2, cf_s=float(ep * E), cf_r=float(E))
    rng = np.random.default_rng(3)
    expert_TK = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32))
    gate_TK = jnp.asarray(rng.uniform(size=(T, K)).astype(np.float32))
    x_TL = jnp.asarray(rng.normal(size=(T, L)).astype(np.float32))
    w = _weights(rng, E, L, F)
    y_cap, n_send, n_recv = capacity_experts(x_TL, expert_TK, gate_TK, *w, cfg, None)
    y_free = jax.jit(dropless_experts)(x_TL, expert_TK, gate_TK, *w)
    assert (float(n_send), float(n_recv)) == (0.0, 0.0)
    np.testing.assert_allclose(np.asarray(y_cap), np.asarray(y_free), rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_the_transport_only_for_kept_rows():
    cfg = _cfg(E=4, K=1, ep=2, waves=1)
    rng = np.random.default_rng(1)
    x_TL = jnp.asarray(rng.normal(size=(8, 16)).astype(np.float32))
    expert_TK = jnp.zeros((8, 1), jnp.int32)
    w = _weights(rng, 4, 16, 8)

    def f(x, g):
        return jnp.sum(capacity_experts(x, expert_TK, g, *w, cfg, None)[0])

    gx, gg = jax.jit(jax.grad(f, argnums=(0, 1)))(x_TL, jnp.ones((8, 1), jnp.float32))
    has_grad = np.abs(np.asarray(gx)).sum(axis=1) > 0
    assert has_grad.tolist() == [True, True] + [False] * 6
    assert np.count_nonzero(np.asarray(gg)) == 2


def test_gradients_equal_those_of_the_kept_assignments_computed_densely():
    """On a skewed routing with drops on both sides: every gradient (tokens, gates, the three
    expert weights) equals the gradient of sum over kept (t, j) of gate * expert(x_t), and the
    gradient's program holds no floating-point scatter-add (the transport's row maps transpose
    to gathers, not to atomics that pile onto one zero row)."""
    from tests.engines.test_jax_fast import _float_scatter_adds

    E, T, K, L, F, ep, waves = 8, 64, 2, 16, 8, 4, 2
    cfg = _cfg(E=E, K=K, ep=ep, waves=waves, cf_s=1.0)
    rng = np.random.default_rng(5)
    p = np.arange(E, 0, -1, dtype=np.float64) ** 2
    expert_TK = np.stack([rng.choice(E, size=K, replace=False, p=p / p.sum()) for _ in range(T)]).astype(np.int32)
    plan = capacity_plan(expert_TK, E, ep, waves, 1.0, 1.0)
    assert plan.send_drop_TK.sum() > 0 and plan.recv_drop_TK.sum() > 0
    kept = jnp.asarray(plan.kept_TK, jnp.float32)
    x = jnp.asarray(rng.normal(size=(T, L)).astype(np.float32))
    gate = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32))
    w = _weights(rng, E, L, F)
    probe = jnp.asarray(rng.normal(size=(T, L)).astype(np.float32))

    def loss_capacity(x, gate, *w):
        return jnp.sum(_capacity_experts(x, jnp.asarray(expert_TK), gate, *w, cfg, None)[0] * probe)

    def loss_dense(x, gate, wg, wu, wd):
        e = jnp.asarray(expert_TK)
        a = jnp.einsum("tl,tklf->tkf", x, wg[e])
        y = jnp.einsum("tkf,tkfl->tkl", jax.nn.silu(a) * jnp.einsum("tl,tklf->tkf", x, wu[e]), wd[e])
        return jnp.sum(jnp.sum(y * (gate * kept)[..., None], axis=1) * probe)

    got = jax.jit(jax.grad(loss_capacity, argnums=(0, 1, 2, 3, 4)))(x, gate, *w)
    want = jax.grad(loss_dense, argnums=(0, 1, 2, 3, 4))(x, gate, *w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
    jaxpr = jax.make_jaxpr(jax.grad(loss_capacity, argnums=(0, 1, 2, 3, 4)))(x, gate, *w).jaxpr
    assert _float_scatter_adds(jaxpr) == []


def test_an_ep_spec_emulated_on_one_gpu_says_how_to_split_it():
    from engines.jax.engine import emulation_warning

    cfg = ModelConfig.from_spec(micro_spec(**{"model.ep_size": 2, "model.dispatch": "capacity"}).model)
    note = emulation_warning("r", cfg, devices=1, backend="gpu")
    assert "model.ep_size 2" in note and "1 GPU(s) visible" in note and "hardware.task_gpus 2" in note
    assert emulation_warning("r", cfg, devices=2, backend="gpu") is None  # the mesh
    assert emulation_warning("r", cfg, devices=1, backend="cpu") is None
    dropless = ModelConfig.from_spec(micro_spec(**{"model.ep_size": 2, "model.dispatch": "dropless"}).model)
    assert "dropless" in emulation_warning("r", dropless, devices=2, backend="gpu")
