"""Forecasts from a real micro ladder trained by the torch engine (no mocks): the law, the
backtest of the largest rung, the hero interval and the grad-norm envelope."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests import cli_fork

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

LADDER_SRC = textwrap.dedent(
    """
    from ladder.experiment import Experiment
    from ladder.presets import micro_spec

    def rung(name, d, layers, steps, role="rung"):
        return micro_spec(name, role=role, **{
            "model.d_model": d, "model.n_heads": d // 8, "model.n_kv_heads": d // 8, "model.n_layers": layers,
            "model.latent_dim": d // 2, "model.expert_hidden": d // 2, "model.shared_hidden": d,
            "data.seq_len": 64, "data.batch_size": 8, "data.total_tokens": 64 * 8 * steps,
            "optim.peak_lr": 0.02 / d ** 0.5, "run.eval_every": 20, "run.eval_batches": 2,
            "run.checkpoint_every": 1000})

    EXPERIMENT = Experiment(
        name="micro_ladder",
        rungs=(rung("r16", 16, 1, 40), rung("r24", 24, 1, 60), rung("r32", 32, 2, 80), rung("r40", 40, 2, 120)),
        hero=rung("hero", 64, 2, 200, role="hero"),
    )
    """
)


@pytest.fixture(scope="module")
def trained_ladder(tmp_path_factory):
    """The micro ladder's rungs trained into a ledger root, as `ladder submit` lays them out."""
    from engines.registry import get_engine
    from ladder.experiment import load_experiment
    from ladder.ledger import run_dir_for, write_spec_file

    base = tmp_path_factory.mktemp("ladder")
    exp_file = base / "micro_ladder.py"
    exp_file.write_text(LADDER_SRC)
    root = base / "root"
    exp = load_experiment(exp_file)
    eng = get_engine("torch")
    for spec in exp.rungs:
        d = run_dir_for(root, exp.name, spec)
        write_spec_file(d, spec)
        for _ in eng.train(spec, d):
            pass
    return exp_file, root, exp


def test_forecast_cli_writes_hero_interval_and_backtest(trained_ladder):
    exp_file, root, exp = trained_ladder
    out = cli_fork.ladder("forecast", exp_file, "--root", root, "--no-tracking", "--json", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    fc = json.loads(out.stdout)
    fl = fc["hero"]["final_loss"]
    assert fl["lo"] < fl["mean"] < fl["hi"]
    assert fc["law"]["converged"]
    bt = fc["backtest"]
    assert bt["held_out"] == "r40"
    print(f"micro ladder backtest of r40: predicted {bt['predicted']:.4f} actual {bt['actual']:.4f} "
          f"error {100 * bt['rel_error']:+.2f}%")
    assert abs(bt["rel_error"]) < 0.15  # a real fit on real losses, not a constant
    assert (root / "analysis" / "micro_ladder" / "forecast.json").exists()


def test_larger_hero_is_forecast_below_every_rung(trained_ladder):
    from analysis.forecast.hero import RungRun, forecast
    from analysis.runs.metrics import read_metrics_frame
    from ladder.ledger import run_dir_for

    _, root, exp = trained_ladder
    rungs = [RungRun(s, run_dir_for(root, exp.name, s), read_metrics_frame(run_dir_for(root, exp.name, s) / "metrics.jsonl"))
             for s in exp.rungs]
    fc = forecast(exp.name, rungs, exp.hero)
    assert fc.final_loss["mean"] < min(r.final_loss for r in rungs)


def test_grad_norm_envelope_brackets_its_median(trained_ladder):
    from analysis.forecast.hero import RungRun, grad_norm_envelope
    from analysis.runs.metrics import read_metrics_frame
    from ladder.ledger import run_dir_for

    _, root, exp = trained_ladder
    rungs = [RungRun(s, run_dir_for(root, exp.name, s), read_metrics_frame(run_dir_for(root, exp.name, s) / "metrics.jsonl"))
             for s in exp.rungs]
    env = grad_norm_envelope(rungs, exp.hero)
    import numpy as np

    mean, lo, hi = (np.array(env[k]) for k in ("mean", "lo", "hi"))
    ok = np.isfinite(mean)
    assert ok.sum() > 10 and np.all(lo[ok] <= mean[ok]) and np.all(mean[ok] <= hi[ok]) and np.all(mean[ok] > 0)


def test_forecast_with_too_few_finished_rungs_says_so(tmp_path):
    exp_file = tmp_path / "micro_ladder.py"
    exp_file.write_text(LADDER_SRC)
    out = cli_fork.ladder("forecast", exp_file, "--root", tmp_path / "empty", "--no-tracking", cwd=ROOT)
    assert out.returncode == 2 and "at least 3 finished rungs" in out.stderr


def test_holdout_last_reports_the_largest_rung(trained_ladder):
    exp_file, root, _ = trained_ladder
    out = cli_fork.ladder("forecast", exp_file, "--root", root, "--no-tracking", "--holdout", "LAST", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "holdout r40: predicted" in out.stdout


def test_forecast_reports_warnings_and_the_coverage_of_every_interval(trained_ladder):
    from analysis.forecast.hero import RungRun, forecast
    from analysis.runs.metrics import read_metrics_frame
    from ladder.ledger import run_dir_for

    _, root, exp = trained_ladder
    rungs = [RungRun(s, run_dir_for(root, exp.name, s), read_metrics_frame(run_dir_for(root, exp.name, s) / "metrics.jsonl"))
             for s in exp.rungs]
    d = forecast(exp.name, rungs, exp.hero).to_dict()
    assert isinstance(d["warnings"], list) and isinstance(d["law"]["warnings"], list)
    assert set(d["coverage"]) == {"final_loss", "grad_norm", "trajectory"}
    fl = d["coverage"]["final_loss"]
    assert fl["held_out"] == ["r40"] and fl["n"] == 1 and 0.0 <= fl["coverage"] <= 1.0
    gn = d["coverage"]["grad_norm"]
    assert gn["n"] > 0 and 0.0 <= gn["coverage"] <= 1.0 and gn["mean_rel_width"] > 0
    assert "coverage" in d["coverage"]["trajectory"] or "error" in d["coverage"]["trajectory"]
    json.dumps(d)  # forecast.json is strict JSON


def test_forecast_json_reads_back_as_the_forecast_that_wrote_it(trained_ladder, tmp_path):
    from analysis.forecast.file import read_hero_forecast
    from analysis.forecast.hero import RungRun, forecast
    from analysis.runs.metrics import read_metrics_frame
    from ladder.ledger import run_dir_for

    _, root, exp = trained_ladder
    rungs = [RungRun(s, run_dir_for(root, exp.name, s), read_metrics_frame(run_dir_for(root, exp.name, s) / "metrics.jsonl"))
             for s in exp.rungs]
    d = forecast(exp.name, rungs, exp.hero).to_dict()
    path = tmp_path / "forecast.json"
    path.write_text(json.dumps(d))
    back = read_hero_forecast(path)
    assert back.to_dict() == json.loads(json.dumps(d)) and back.hero.spec_id == exp.hero.id


def test_each_typed_section_of_a_written_forecast_reads_back_equal(trained_ladder, tmp_path):
    from analysis.forecast.file import read_hero_forecast, write_hero_forecast
    from analysis.forecast.hero import RungRun, forecast
    from analysis.runs.metrics import read_metrics_frame
    from core.fsutil import json_text
    from ladder.ledger import run_dir_for

    _, root, exp = trained_ladder
    rungs = [RungRun(s, run_dir_for(root, exp.name, s), read_metrics_frame(run_dir_for(root, exp.name, s) / "metrics.jsonl"))
             for s in exp.rungs]
    fc = forecast(exp.name, rungs, exp.hero)
    back = read_hero_forecast(write_hero_forecast(tmp_path / "forecast.json", fc))
    for name in ("law", "backtest", "trajectory", "regime", "rung_fits"):
        wrote, read = getattr(fc, name), getattr(back, name)
        assert type(read) is type(wrote) and json_text(read.to_dict()) == json_text(wrote.to_dict()), name
