"""A NaN/inf loss stops the run with status diverged; the checkpoints on disk stay usable."""

import numpy as np
import pytest

from engines.base import DivergedError, read_metrics, read_status
from engines.checkpoint import latest_checkpoint, load_checkpoint
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec


def test_nan_loss_stops_with_status_diverged_and_a_good_checkpoint(tmp_path):
    spec = micro_spec(**{"optim.peak_lr": 1e6, "optim.grad_clip": 1e9, "run.checkpoint_every": 1})
    seen = []
    with pytest.raises(DivergedError, match="at step"):
        for rec in TorchEngine().train(spec, tmp_path):
            seen.append(rec)
    status = read_status(tmp_path)
    assert status["state"] == "diverged"
    bad_step = status["step"]
    assert bad_step < spec.total_steps - 1 and len(seen) == bad_step
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == bad_step and not (np.isfinite(last["loss"]) and np.isfinite(last["grad_norm"]))
    # the newest checkpoint is the state the diverging step started from, complete and finite
    params, opt, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == bad_step
    assert all(np.isfinite(v).all() for v in params.values())
    assert all(np.isfinite(v).all() for v in opt.values())


def test_a_step_launched_behind_a_diverging_one_is_neither_recorded_nor_saved(tmp_path):
    # checkpoints and evals only at the end: every step is read after the next was launched
    spec = micro_spec(**{"optim.peak_lr": 1e6, "optim.grad_clip": 1e9, "run.checkpoint_every": 1000,
                         "run.eval_every": 1000})
    with pytest.raises(DivergedError):
        for _ in TorchEngine().train(spec, tmp_path):
            pass
    bad_step = read_status(tmp_path)["step"]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(bad_step + 1))
    params, opt, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 0  # only the initial weights were ever saved
    assert all(np.isfinite(v).all() for v in params.values())
