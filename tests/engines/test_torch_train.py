"""The micro spec really trains on real text, in both dispatch modes, and leaves a complete run dir."""

import numpy as np
import pytest

from engines.base import read_metrics, read_status
from engines.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from engines.data import TokenStream
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

SPEC = micro_spec(**{"optim.peak_lr": 1e-2})


@pytest.fixture(scope="module")
def unigram():
    return TokenStream.from_spec(SPEC).unigram_entropy()


@pytest.fixture(scope="module")
def dropless_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dropless")
    recs = list(TorchEngine().train(SPEC, run_dir))
    return run_dir, recs


@pytest.fixture(scope="module")
def capacity_run(tmp_path_factory):
    spec = SPEC.replace(**{"model.dispatch": "capacity", "model.capacity_factor_send": 1.0,
                           "model.capacity_factor_recv": 1.0})
    run_dir = tmp_path_factory.mktemp("capacity")
    return run_dir, list(TorchEngine().train(spec, run_dir))


def test_dropless_loss_falls_well_below_the_unigram_entropy(dropless_run, unigram):
    _, recs = dropless_run
    assert recs[0].loss > unigram  # starts near ln(256) = 5.55
    assert recs[-1].eval_loss < unigram - 0.3
    assert all(r.drop_frac_send == 0 and r.drop_frac_recv == 0 for r in recs)


def test_capacity_mode_trains_and_counts_its_drops(capacity_run, unigram):
    _, recs = capacity_run
    assert recs[-1].eval_loss < unigram - 0.3
    assert np.mean([r.drop_frac_recv for r in recs]) > 0
    assert all(0 <= r.drop_frac_send < 1 and 0 <= r.drop_frac_recv < 1 for r in recs)


def test_metrics_file_holds_every_step_once_with_evals_where_due(dropless_run):
    run_dir, recs = dropless_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(SPEC.total_steps))
    evals = [r["step"] for r in rows if r["eval_loss"] is not None]
    assert evals == [24, 49, 74, 99]  # every run.eval_every updates, the last included
    assert rows[-1]["tokens"] == SPEC.total_steps * SPEC.data.tokens_per_step
    for key in ("loss", "grad_norm", "lr", "z_loss", "aux_loss", "router_entropy", "expert_load_max",
                "tokens_per_s", "mfu"):
        assert all(np.isfinite(r[key]) and r[key] >= 0 for r in rows), key
    assert all(r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["lr"] == pytest.approx(SPEC.optim.peak_lr / 5)  # warmup from core.schedule


def test_run_ends_finished_with_the_newest_checkpoints_kept(dropless_run):
    run_dir, recs = dropless_run
    assert read_status(run_dir)["state"] == "finished"
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_00000075", "step_00000100"]
    params, opt, state = load_checkpoint(latest_checkpoint(run_dir))
    assert state["step"] == 100 and state["engine"] == "torch" and state["spec_id"] == SPEC.id
    assert int(opt["step"]) == 100
    assert all(v.dtype == np.float32 for v in params.values())


def test_rerunning_a_finished_run_trains_nothing(dropless_run):
    run_dir, _ = dropless_run
    assert list(TorchEngine().train(SPEC, run_dir)) == []


def test_a_different_spec_refuses_the_run_dir(dropless_run):
    run_dir, _ = dropless_run
    with pytest.raises(ValueError, match="belongs to spec"):
        next(TorchEngine().train(SPEC.replace(**{"optim.peak_lr": 2e-2}), run_dir))


def test_every_step_reports_its_own_throughput(dropless_run):
    # steps are read one late: each record's time must still be its own step's (no record, such
    # as one read at an eval, credited with a fraction or a multiple of a step's time)
    tps = np.array([r.tokens_per_s for r in dropless_run[1][1:]])
    assert np.all(tps < 20 * np.median(tps)) and np.all(tps > np.median(tps) / 20)
