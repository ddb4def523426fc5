"""The Trainer's callbacks (engines/trainer.Callback): called in list order before each step is
launched, each seeing what the one before it returned, and after each record; with none, or with
callbacks that change nothing, a run is the run without them, value for value."""

from __future__ import annotations

import numpy as np
import torch

from engines.base import read_metrics
from engines.torch.step import TorchStep
from engines.trainer import Callback, Trainer
from ladder.presets import micro_spec
from tests.engines.test_trainer_reference import SyntheticStream

SPEC = micro_spec(**{"data.seq_len": 16, "data.batch_size": 2, "data.total_tokens": 16 * 2 * 4,
                     "run.eval_every": 100, "run.checkpoint_every": 100})


class Log(Callback):
    def __init__(self, name: str, seen: list, scale: float = 1.0):
        self.name, self.seen, self.scale = name, seen, scale

    def pre_step(self, step, batch_BS1, lr):
        self.seen.append((self.name, "pre", step, lr))
        return batch_BS1, lr * self.scale

    def post_step(self, record):
        self.seen.append((self.name, "post", record.step, record.lr))


def _fit(run_dir, callbacks=()):
    torch.set_num_threads(1)
    trainer = Trainer(SPEC, run_dir, TorchStep(SPEC, torch.device("cpu")), checkpoints=False,
                      stream=SyntheticStream(SPEC), callbacks=callbacks)
    return list(trainer.fit())


def test_callbacks_run_in_order_and_what_pre_step_returns_is_what_the_step_uses(tmp_path):
    seen: list = []
    records = _fit(tmp_path / "a", [Log("first", seen, scale=0.5), Log("second", seen)])
    schedule = [r.lr * 2 for r in records]  # the first halves each step's LR; the second sees that
    for step in range(SPEC.total_steps):
        pre = [s for s in seen if s[1] == "pre" and s[2] == step]
        assert pre == [("first", "pre", step, schedule[step]), ("second", "pre", step, schedule[step] / 2)]
        post = [s for s in seen if s[1] == "post" and s[2] == step]
        assert post == [("first", "post", step, records[step].lr), ("second", "post", step, records[step].lr)]
    # the first step's post_step comes after its pre_step (and, with lookahead, maybe after the next one's)
    assert seen.index(("first", "post", 0, records[0].lr)) > seen.index(("second", "pre", 0, schedule[0] / 2))


def test_callbacks_that_change_nothing_leave_the_run_as_it_is(tmp_path):
    plain = _fit(tmp_path / "plain")
    with_noop = _fit(tmp_path / "noop", [Callback(), Log("log", [])])
    keys = ("loss", "grad_norm", "lr", "z_loss", "aux_loss", "expert_load_max")
    for a, b in zip(read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "noop")):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert len(plain) == len(with_noop) == SPEC.total_steps
    assert np.isfinite([r.loss for r in plain]).all()
