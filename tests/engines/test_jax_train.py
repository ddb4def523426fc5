"""The JAX engine really trains the micro spec on real text and leaves a complete run dir."""

import jax
import numpy as np
import pytest

from engines.base import DivergedError, read_metrics, read_status
from engines.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from engines.data import TokenStream
from engines.jax.engine import JaxEngine, _compiled_steps
from engines.registry import get_engine
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

SPEC = micro_spec(engine="jax", **{"optim.peak_lr": 1e-2})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("jax-dropless")
    _compiled_steps.cache_clear()  # step 0 compiles, whatever ran earlier in this process
    jax.clear_caches()
    return run_dir, list(JaxEngine().train(SPEC, run_dir))


def test_the_registry_finds_the_jax_engine():
    assert isinstance(get_engine("jax"), JaxEngine) and get_engine("jax").name == "jax"


def test_loss_falls_well_below_the_unigram_entropy(run):
    _, recs = run
    unigram = TokenStream.from_spec(SPEC).unigram_entropy()
    assert recs[0].loss > unigram  # starts near ln(256) = 5.55
    assert recs[-1].eval_loss < unigram - 0.3
    assert all(r.drop_frac_send == 0 and r.drop_frac_recv == 0 for r in recs)


def test_metrics_file_holds_every_step_once_with_evals_where_due(run):
    run_dir, recs = run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(SPEC.total_steps))
    assert [r["step"] for r in rows if r["eval_loss"] is not None] == [24, 49, 74, 99]
    assert rows[-1]["tokens"] == SPEC.total_steps * SPEC.data.tokens_per_step
    for key in ("loss", "grad_norm", "lr", "z_loss", "aux_loss", "router_entropy", "expert_load_max",
                "tokens_per_s", "mfu"):
        assert all(np.isfinite(r[key]) and r[key] > 0 for r in rows), key
    assert rows[0]["lr"] == pytest.approx(SPEC.optim.peak_lr / 5)  # warmup from core.schedule
    # the grad norm is logged before clipping: early steps exceed the clip threshold
    assert max(r["grad_norm"] for r in rows) > SPEC.optim.grad_clip
    assert {"router_z_loss", "total_loss"} <= set(rows[0]["extra"])


def test_run_ends_finished_with_engine_neutral_checkpoints(run):
    run_dir, _ = run
    assert read_status(run_dir)["state"] == "finished"
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_00000075", "step_00000100"]
    params, opt, state = load_checkpoint(latest_checkpoint(run_dir))
    assert state["step"] == 100 and state["engine"] == "jax" and state["spec_id"] == SPEC.id
    assert int(opt["step"]) == 100
    assert "blocks.1.moe.experts.w_gate" in params and "m/blocks.1.moe.experts.w_gate" in opt
    assert "m/blocks.0.moe.router_bias" not in opt  # a buffer: never trained
    assert all(v.dtype == np.float32 for v in params.values())


def test_rerunning_a_finished_run_trains_nothing(run):
    run_dir, _ = run
    assert list(JaxEngine().train(SPEC, run_dir)) == []


def test_a_different_spec_refuses_the_run_dir(run):
    run_dir, _ = run
    with pytest.raises(ValueError, match="belongs to spec"):
        next(JaxEngine().train(SPEC.replace(**{"optim.peak_lr": 2e-2}), run_dir))


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    # an absurd learning rate: step 0 is fine, its update overflows the weights, step 1 is not
    spec = SPEC.replace(**{"optim.peak_lr": 1e30, "run.checkpoint_every": 1})
    seen = []
    with pytest.raises(DivergedError, match="step 1"):
        for rec in JaxEngine().train(spec, tmp_path):
            seen.append(rec)
    assert [r.step for r in seen] == [0]
    status = read_status(tmp_path)
    assert status["state"] == "diverged" and status["step"] == 1
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1] and not np.isfinite(rows[1]["loss"] * rows[1]["grad_norm"])
    params, _, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 1
    assert all(np.isfinite(v).all() for v in params.values())


def test_every_step_reports_its_own_throughput(run):
    # steps are read one late: each record's time must still be its own step's. Step 0 compiles;
    # were its time read with step 1's, step 1 would carry the compilation (a load stall of a
    # quarter of a compilation is what this leaves room for, not a 20x step-to-step ratio)
    tps = np.array([r.tokens_per_s for r in run[1]])
    assert np.all(np.isfinite(tps)) and np.all(tps > 0)
    seconds = 1.0 / tps  # per token, so per step up to the constant tokens a step
    assert seconds[1] < seconds[0] / 4 and np.median(seconds[1:]) < seconds[0] / 4
