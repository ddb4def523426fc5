"""Balancing and z-losses change what they should: two short trainings differing in one knob."""

import numpy as np
import pytest
import torch

from engines.checkpoint import latest_checkpoint, load_checkpoint
from engines.data import TokenStream
from engines.torch.engine import TorchEngine
from engines.torch.forward import Forward
from engines.torch.model import MoETransformer, init_params
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

# without an aux loss this router collapses onto a few experts: room for balancing to show
BASE = micro_spec(**{"data.total_tokens": 64 * 8 * 40, "optim.aux_loss": 0.0,
                     "run.checkpoint_every": 1000, "run.eval_every": 1000})
_runs: dict = {}


def _late_mean(tmp_path_factory, key: str, **changes) -> float:
    """Mean of a metric over the last 10 steps of a 40-step run (runs are shared between tests)."""
    name = repr(sorted(changes.items()))
    if name not in _runs:
        spec = BASE.replace(**changes) if changes else BASE
        _runs[name] = list(TorchEngine().train(spec, tmp_path_factory.mktemp("router")))
    recs = _runs[name][-10:]
    return float(np.mean([r.extra[key] if key in r.extra else getattr(r, key) for r in recs]))


def test_bias_balancing_evens_out_expert_load(tmp_path_factory):
    off = _late_mean(tmp_path_factory, "expert_load_max")
    on = _late_mean(tmp_path_factory, "expert_load_max", **{"model.router_bias_balancing": True})
    assert off > 3.0  # near E/K = 4: a collapsed router
    # 4.0 -> 3.2 on the stream without the eval set's documents (it was more than 0.8 on the old one)
    assert on < off - 0.5


def test_aux_loss_evens_out_expert_load(tmp_path_factory):
    off = _late_mean(tmp_path_factory, "expert_load_max")
    on = _late_mean(tmp_path_factory, "expert_load_max", **{"optim.aux_loss": 1.0})
    assert on < off - 0.8
    assert _late_mean(tmp_path_factory, "aux_loss", **{"optim.aux_loss": 1.0}) < _late_mean(tmp_path_factory, "aux_loss")


def test_router_z_loss_shrinks_router_logits(tmp_path_factory):
    off = _late_mean(tmp_path_factory, "router_z_loss", **{"optim.router_z_loss": 0.0})
    on = _late_mean(tmp_path_factory, "router_z_loss", **{"optim.router_z_loss": 1.0})
    assert on < 0.5 * off


def test_logit_z_loss_shrinks_output_log_partition(tmp_path_factory):
    off = _late_mean(tmp_path_factory, "z_loss")
    on = _late_mean(tmp_path_factory, "z_loss", **{"optim.z_loss": 0.1})
    assert on < off - 2.0


def test_bias_moves_against_the_load_error_by_the_rate(tmp_path):
    spec = BASE.replace(**{"model.router_bias_balancing": True, "model.router_bias_rate": 0.01,
                           "data.total_tokens": 64 * 8})
    rec = next(TorchEngine().train(spec, tmp_path))
    params, _, _ = load_checkpoint(latest_checkpoint(tmp_path))
    model = MoETransformer(spec.model)
    model.load_numpy(init_params(spec.model, spec.seed))
    with torch.no_grad():
        _, out = Forward(torch.device("cpu"))(model, torch.from_numpy(TokenStream.from_spec(spec).batch(0)).long(), spec.optim)
    for i, load_E in enumerate(out["load_LE"]):
        want = 0.01 * np.sign(load_E.mean().item() - load_E.numpy())
        assert np.array_equal(params[f"blocks.{i}.moe.router_bias"], want.astype(np.float32))
    assert rec.step == 0
