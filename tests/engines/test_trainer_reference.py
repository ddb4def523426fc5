"""The trainer harness changed no number: tiny CPU runs through engines/trainer.py give the
per-step values the engines' own loops gave before it (tests/engines/reference/tiny_steps.json),
resumed mid-run too: bit for bit on the CPU the file was made on (x86-64, one thread), to float32
rounding on others (tests/engines/pins.py). The tokens are synthetic (numpy's PCG64 seeded by the
step), so the pin holds whatever the data pipeline does."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.base import read_metrics
from engines.torch.step import TorchStep
from engines.trainer import Trainer
from ladder.presets import micro_spec
from tests.engines.pins import same_steps

REFERENCE = json.loads((Path(__file__).parent / "reference" / "tiny_steps.json").read_text())
KEYS = tuple(REFERENCE["torch"][0])
CAPACITY = {"model.dispatch": "capacity", "model.n_waves": 2, "model.capacity_factor_send": 1.0,
            "model.capacity_factor_recv": 1.0, "model.init_std": 0.3}


class SyntheticStream:
    """Tokens that depend on (seed, step) only, with TokenStream's interface."""

    fingerprint = "synthetic-tokens"

    def __init__(self, spec):
        self.B, self.S, self.V, self.seed = spec.data.batch_size, spec.data.seq_len, spec.model.vocab_size, spec.seed
        self.eval_batches = spec.run.eval_batches

    def _tokens(self, key):
        return np.random.default_rng([self.seed, *key]).integers(0, self.V, (self.B, self.S + 1)).astype(np.int32)

    def batch_size_at(self, step):
        return self.B

    def batch(self, step, rank=0, world=1):
        return self._tokens([0, step])[rank * self.B // world:(rank + 1) * self.B // world]

    def eval_plan(self, windows=None):
        # one group per old eval batch (the pinned eval losses are the mean of these batches' losses)
        return [("synthetic", np.arange(i, i + 1)) for i in range(self.eval_batches if windows is None else windows // 8)]

    def eval_batch(self, source, rows, seq_len=None):
        return self._tokens([1, int(rows[0])])

    def base_mixture(self):
        return {"synthetic": 1.0}

    def state(self, done):
        return {"step": done, "fingerprint": self.fingerprint}


def _values(run_dir) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in read_metrics(run_dir)]


def _torch_fit(spec, run_dir, stop_at=None):
    torch.set_num_threads(1)
    for rec in Trainer(spec, run_dir, TorchStep(spec, torch.device("cpu")),
                       stream=SyntheticStream(spec)).fit():
        if rec.step == stop_at:
            break


def test_torch_steps_equal_the_reference(tmp_path):
    spec = micro_spec("t", **REFERENCE["changes"])
    _torch_fit(spec, tmp_path)
    assert same_steps(_values(tmp_path), REFERENCE["torch"])


def test_torch_steps_resumed_mid_run_equal_the_reference(tmp_path):
    spec = micro_spec("t", **REFERENCE["changes"])
    _torch_fit(spec, tmp_path, stop_at=7)  # the checkpoint at 5 stays; steps 5-7 are done again
    _torch_fit(spec, tmp_path)
    assert same_steps(_values(tmp_path), REFERENCE["torch"])


def test_torch_capacity_steps_equal_the_reference(tmp_path):
    spec = micro_spec("c", **REFERENCE["changes"], **CAPACITY)
    _torch_fit(spec, tmp_path)
    assert same_steps(_values(tmp_path), REFERENCE["capacity"])


@pytest.mark.slow
def test_jax_steps_equal_the_reference(tmp_path):
    from engines.jax.engine import JaxEngine

    spec = micro_spec("j", **REFERENCE["changes"]).replace(engine="jax")
    list(Trainer(spec, tmp_path, JaxEngine().step_module(spec), stream=SyntheticStream(spec)).fit())
    assert same_steps(_values(tmp_path), REFERENCE["jax"])
