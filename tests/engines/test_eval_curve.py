"""One eval curve: a periodic eval scores a stratified sample of each source's fixed eval set and
combines the sources with the final eval's weights, so at the last step it estimates the final's
quantity (the very value when its sample is the whole set), while the final eval still scores every
window in the set's reading order. Tiny CPU runs of the real engines on real text."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.rundir import RunDir
from engines.data import EVAL_ROWS, TokenStream
from engines.evalset import periodic_windows
from engines.torch.engine import TorchStep
from engines.trainer import Trainer
from tests.support import tiny_spec

STEPS, EVERY = 12, 4


def _spec(engine: str, eval_batches: int):
    return tiny_spec(f"curve-{engine}-{eval_batches}", steps=STEPS, checkpoint_every=100,
                     **{"run.eval_every": EVERY, "run.eval_batches": eval_batches}).replace(engine=engine)


def _module(spec):
    if spec.engine == "jax":
        from engines.jax.engine import JaxEngine

        return JaxEngine().step_module(spec)
    torch.set_num_threads(1)
    return TorchStep(spec, torch.device("cpu"))


def _train(spec, run_dir):
    module = _module(spec)
    list(Trainer(spec, run_dir, module).fit())
    evals = [r for r in RunDir(run_dir).read_metrics(warn=None) if r.get("eval_loss") is not None]
    return module, evals


@pytest.fixture(scope="module")
def stream():
    return TokenStream.from_spec(_spec("torch", 1))


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """A torch run whose periodic evals score 8 windows a source (of 64)."""
    spec = _spec("torch", 1)
    run_dir = tmp_path_factory.mktemp("sampled")
    module, evals = _train(spec, run_dir)
    return spec, run_dir, module, evals


def test_the_periodic_sample_takes_one_window_from_each_stratum_of_positions(stream):
    for name in stream.names:
        starts = stream.sources[name].evalset.starts_W
        idx = periodic_windows(starts, 16)
        strata = np.array_split(np.argsort(starts, kind="stable"), 16)
        assert [len(np.intersect1d(s, idx)) for s in strata] == [1] * 16
        assert sorted(int(s.min()) for s in strata) == idx.tolist()  # each stratum's first in reading order


def test_a_periodic_sample_as_large_as_the_set_is_the_final_plan(stream):
    every = max(stream.sources[n].evalset.n_windows for n in stream.names)
    final, periodic = stream.eval_plan(None), stream.eval_plan(every)
    assert [s for s, _ in periodic] == [s for s, _ in final]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(periodic, final))


def test_the_final_eval_scores_every_window_in_reading_order(stream):
    for name in stream.names:
        rows = np.concatenate([r for s, r in stream.eval_plan(None) if s == name])
        assert np.array_equal(rows, np.arange(stream.sources[name].evalset.n_windows))


@pytest.mark.parametrize("engine", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_at_the_last_step_a_periodic_eval_of_the_whole_set_is_the_final(engine, tmp_path, stream):
    every = max(stream.sources[n].evalset.n_windows for n in stream.names)
    spec = _spec(engine, -(-every // EVAL_ROWS))  # groups enough for every window of each source
    _, evals = _train(spec, tmp_path)
    final = evals[-1]["extra"]
    assert final["eval_final"] is True
    assert final["eval_loss_periodic"] == evals[-1]["eval_loss"]


def test_periodic_and_final_evals_weight_the_sources_alike(sampled):
    spec, _, _, evals = sampled
    total = sum(s.weight for s in spec.data.sources)
    w = {s.name: s.weight / total for s in spec.data.sources}
    assert [r["extra"]["eval_final"] for r in evals] == [False, False, True]
    for r in evals:
        assert math.isclose(r["eval_loss"], sum(w[n] * r["extra"][f"eval_loss/{n}"] for n in w), rel_tol=1e-12)


def test_the_final_records_the_periodic_evals_value_at_its_step(sampled, stream):
    spec, run_dir, module, evals = sampled
    again = Trainer(spec, run_dir, module, checkpoints=False, stream=stream).evaluate(final=False)
    assert again["eval_windows"] == EVAL_ROWS * len(stream.names)
    assert evals[-1]["extra"]["eval_loss_periodic"] == pytest.approx(again["eval_loss"], rel=1e-6)


def test_mlflow_logs_the_final_eval_under_its_own_name(sampled):
    from ladder.tracking import record_metrics

    *periodic, final = [dict(record_metrics(r)) for r in sampled[3]]
    assert all("eval_loss" in m and "eval_loss_final" not in m for m in periodic)
    assert "eval_loss" not in final and final["eval_loss_final"] == sampled[3][-1]["eval_loss"]
    assert final["eval_loss_periodic"] == sampled[3][-1]["extra"]["eval_loss_periodic"]


def test_every_eval_record_says_which_periodic_sample_it_scored(sampled):
    spec, _, _, evals = sampled
    assert [r["extra"]["eval_periodic_windows"] for r in evals] == [spec.run.eval_batches * EVAL_ROWS] * len(evals)
