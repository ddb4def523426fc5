"""Both engines honour a spec's optim.moments: with bf16 a short run trains, its checkpoints hold
the moments as fp32 arrays that are exactly bf16 values, and the two engines' losses still agree
with each other and with their fp32-moment runs within bf16's rounding."""

import numpy as np
import pytest

from engines.checkpoint import latest_checkpoint, load_checkpoint
from engines.jax.engine import JaxEngine
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

SPEC = micro_spec(**{"data.total_tokens": 64 * 8 * 12, "run.checkpoint_every": 6})


def _is_bf16(a: np.ndarray) -> bool:
    """fp32 values whose low 16 bits are zero: bf16 numbers widened exactly."""
    return a.dtype == np.float32 and not (a.view(np.uint32) & 0xFFFF).any()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for engine, make in (("torch", lambda: TorchEngine("cpu")), ("jax", JaxEngine)):
        for moments in ("fp32", "bf16"):
            run_dir = tmp_path_factory.mktemp(f"{engine}-{moments}")
            recs = list(make().train(SPEC.replace(engine=engine, **{"optim.moments": moments}), run_dir))
            out[engine, moments] = (run_dir, [r.loss for r in recs])
    return out


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_bf16_moments_are_checkpointed_as_exact_bf16_values(runs, engine):
    run_dir, _ = runs[engine, "bf16"]
    _, opt, state = load_checkpoint(latest_checkpoint(run_dir))
    moments = {k: v for k, v in opt.items() if k != "step"}
    assert moments and all(_is_bf16(v) for v in moments.values())
    _, opt32, _ = load_checkpoint(latest_checkpoint(runs[engine, "fp32"][0]))
    assert not all(_is_bf16(v) for k, v in opt32.items() if k != "step")  # (fp32 moments are not)


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_bf16_moments_train_like_fp32_moments(runs, engine):
    fp32, bf16 = runs[engine, "fp32"][1], runs[engine, "bf16"][1]
    assert len(bf16) == SPEC.total_steps and bf16[-1] < bf16[0] - 0.5
    np.testing.assert_allclose(bf16, fp32, rtol=2e-2)
    assert bf16 != fp32  # the moments really were rounded


def test_both_engines_agree_with_bf16_moments(runs):
    np.testing.assert_allclose(runs["torch", "bf16"][1], runs["jax", "bf16"][1], rtol=1e-2)
