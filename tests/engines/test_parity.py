"""The PyTorch and JAX engines train the same model: from the same checkpoint (written by one,
loaded by the other) they agree on the first loss within 1e-4 and on the loss curve within 1% at
every step, drop the same assignments in capacity mode, and hand a mid-run checkpoint (weights
and AdamW moments) across."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import functools

import numpy as np
import pytest
import torch

from engines.checkpoint import CHECKPOINTS, init_from_checkpoint, step_dir_name
from engines.jax.engine import JaxEngine, configure_jax
from engines.jax.model import ModelConfig
from engines.jax.moe import capacity_experts
from engines.options import TorchKernels
from engines.torch.engine import TorchEngine
from engines.torch.forward import expert_kernels
from engines.torch.model import MoE
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

# keep every checkpoint (a run argument: the spec id does not change)
CAPACITY = micro_spec(**{"model.dispatch": "capacity", "model.capacity_factor_send": 1.0,
                         "model.capacity_factor_recv": 1.0, "model.n_waves": 2,
                         "run.keep_checkpoints": 1000})
DROPLESS = micro_spec(**{"data.total_tokens": 10 * 64 * 8, "run.checkpoint_every": 5,
                         "run.eval_every": 5, "run.keep_checkpoints": 1000})


def _ckpt(run_dir, step):
    return run_dir / CHECKPOINTS / step_dir_name(step)


@pytest.fixture(scope="module")
def capacity_runs(tmp_path_factory):
    """torch trains from its own initial weights; jax trains from torch's step-0 checkpoint."""
    t_dir, j_dir = tmp_path_factory.mktemp("cap-torch"), tmp_path_factory.mktemp("cap-jax")
    t = list(TorchEngine("cpu").train(CAPACITY, t_dir))
    init_from_checkpoint(j_dir, _ckpt(t_dir, 0))
    j = list(JaxEngine().train(CAPACITY.replace(engine="jax"), j_dir))
    return t, j


@pytest.fixture(scope="module")
def dropless_runs(tmp_path_factory):
    """jax trains from its own initial weights; torch trains from jax's step-0 checkpoint, and
    again from jax's step-5 checkpoint (weights and moments mid-run)."""
    j_dir = tmp_path_factory.mktemp("free-jax")
    t0_dir, t5_dir = tmp_path_factory.mktemp("free-torch-0"), tmp_path_factory.mktemp("free-torch-5")
    j = list(JaxEngine().train(DROPLESS.replace(engine="jax"), j_dir))
    init_from_checkpoint(t0_dir, _ckpt(j_dir, 0))
    init_from_checkpoint(t5_dir, _ckpt(j_dir, 5))
    t0 = list(TorchEngine("cpu").train(DROPLESS, t0_dir))
    t5 = list(TorchEngine("cpu").train(DROPLESS, t5_dir))
    return j, t0, t5


def test_first_step_loss_agrees_from_the_other_engines_checkpoint(capacity_runs, dropless_runs):
    t, j = capacity_runs
    assert abs(t[0].loss - j[0].loss) < 1e-4
    j_free, t_free, _ = dropless_runs
    assert abs(t_free[0].loss - j_free[0].loss) < 1e-4
    assert abs(t_free[0].grad_norm - j_free[0].grad_norm) < 1e-4 * t_free[0].grad_norm


def test_loss_curves_agree_within_one_percent_over_100_steps(capacity_runs):
    t, j = capacity_runs
    assert [r.step for r in t] == [r.step for r in j] == list(range(100))
    rel = np.array([abs(a.loss - b.loss) / a.loss for a, b in zip(t, j)])
    assert rel.max() < 0.01, (rel.argmax(), rel.max())
    evals = [(a.eval_loss, b.eval_loss) for a, b in zip(t, j) if a.eval_loss is not None]
    assert len(evals) == 4 and all(abs(a - b) / a < 0.01 for a, b in evals)
    assert t[-1].loss < t[0].loss - 1.5  # the curves compared are real training curves


def test_capacity_drops_are_equal_while_routing_is_equal(capacity_runs):
    t, j = capacity_runs
    # the same weights and batch route identically at the first step: the drop counts are exact
    assert (t[0].drop_frac_send, t[0].drop_frac_recv) == (j[0].drop_frac_send, j[0].drop_frac_recv)
    assert t[0].drop_frac_recv > 0


def test_capacity_dispatch_of_both_engines_on_a_hand_built_routing():
    configure_jax()
    spec = CAPACITY.replace(**{"model.ep_size": 4})
    m = spec.model
    T, K, E, L = 64, m.top_k, m.n_routed_experts, m.expert_dim
    rng = np.random.default_rng(7)
    p = np.arange(E, 0, -1, dtype=np.float64) ** 2  # skewed: popular low experts
    expert_TK = np.stack([rng.choice(E, size=K, replace=False, p=p / p.sum()) for _ in range(T)])
    gate_TK = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
    x_TL = rng.normal(size=(T, L)).astype(np.float32)
    moe = MoE(m)
    with torch.no_grad():
        for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down):
            w.copy_(torch.from_numpy(rng.normal(0, 0.3, size=tuple(w.shape)).astype(np.float32)))
        kernels = functools.partial(expert_kernels, cdt=torch.float32, o=TorchKernels.reference())
        y_TKL, t_send, t_recv = moe.experts(torch.from_numpy(x_TL), torch.from_numpy(expert_TK), torch.from_numpy(gate_TK),
                                            kernels)
        y_torch = (y_TKL * torch.from_numpy(gate_TK)[..., None]).sum(1).numpy()
    weights = [jnp.asarray(w.detach().numpy()) for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down)]
    fn = jax.jit(capacity_experts, static_argnums=(6, 7))
    y_jax, j_send, j_recv = fn(jnp.asarray(x_TL), jnp.asarray(expert_TK, jnp.int32), jnp.asarray(gate_TK),
                               *weights, ModelConfig.from_spec(m), None)
    assert (float(t_send), float(t_recv)) == (float(j_send), float(j_recv))
    assert float(t_send) > 0 and float(t_recv) > 0
    np.testing.assert_allclose(np.asarray(y_jax), y_torch, rtol=1e-5, atol=1e-5)


def test_a_mid_run_jax_checkpoint_continues_in_torch(dropless_runs):
    j, t0, t5 = dropless_runs
    assert [r.step for r in t5] == list(range(5, 10))
    for a, b in zip(j[5:], t5):
        assert abs(a.loss - b.loss) < 1e-4, (a.step, a.loss, b.loss)
    rel = [abs(a.loss - b.loss) / a.loss for a, b in zip(j, t0)]
    assert max(rel) < 0.01
