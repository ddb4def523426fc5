"""The trainer scores the fixed eval set: per source and for the mixture with standard errors, a
periodic subset and the whole set at the end, and records the set's fingerprint in status.json."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from core.rundir import RunDir
from engines.data import TokenStream
from engines.torch.engine import TorchStep
from engines.trainer import Trainer, score_eval
from ladder.presets import micro_spec


def test_score_eval_weights_sources_by_the_base_mixture_and_propagates_their_errors():
    plan = [("a", np.arange(0, 8)), ("a", np.arange(8, 16)), ("b", np.arange(0, 8)), ("b", np.arange(8, 16))]
    out = score_eval(plan, [1.0, 3.0, 10.0, 10.0], {"a": 0.75, "b": 0.25})
    assert out["eval_loss/a"] == 2.0 and out["eval_loss/b"] == 10.0
    assert math.isclose(out["eval_loss_se/a"], 1.0)  # sd of the two group means / sqrt(2)
    assert out["eval_loss_se/b"] == 0.0
    assert math.isclose(out["eval_loss"], 0.75 * 2 + 0.25 * 10)
    assert math.isclose(out["eval_loss_se"], 0.75 * 1.0)
    assert out["eval_windows"] == 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = micro_spec("yard", **{"data.total_tokens": 64 * 8 * 30, "run.eval_every": 10, "run.eval_batches": 1})
    run_dir = tmp_path_factory.mktemp("yard")
    torch.set_num_threads(1)
    list(Trainer(spec, run_dir, TorchStep(spec, torch.device("cpu"))).fit())
    return spec, RunDir(run_dir)


def test_status_records_the_eval_sets_fingerprint(trained):
    spec, rd = trained
    status = rd.read_status()
    assert status["eval_set"]["fingerprint"] == TokenStream.from_spec(spec).eval_fingerprint
    assert set(status["eval_set"]["sources"]) == {s.name for s in spec.data.sources}


def test_final_eval_scores_every_window_and_periodic_ones_a_subset(trained):
    spec, rd = trained
    evals = [r for r in rd.read_metrics(warn=None) if r.get("eval_loss") is not None]
    stream = TokenStream.from_spec(spec)
    every = sum(stream.sources[n].evalset.n_windows for n in stream.names)
    periodic, final = evals[:-1], evals[-1]
    assert final["step"] == spec.total_steps - 1 and final["extra"]["eval_final"] is True
    assert final["extra"]["eval_windows"] == every
    assert all(r["extra"]["eval_windows"] == 8 * len(stream.names) for r in periodic)
    for name in stream.names:
        assert final["extra"][f"eval_loss_se/{name}"] > 0
    assert all(r["extra"]["eval_loss_periodic"] == r["eval_loss"] for r in periodic)
    assert final["extra"]["eval_loss_periodic"] != final["eval_loss"]
    assert json.dumps(final)  # every value is plain JSON
