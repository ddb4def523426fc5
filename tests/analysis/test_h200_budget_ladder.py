"""The H200 ladder in the hero's regime (experiments/proxy_h200.py; its rungs in
docs/results/h200_ladder/budget_rungs.tar.gz): every rung finished on its planned steps at the hero's
batch without repeating data, and `ladder forecast` on them reproduces the forecast committed before
the hero's new seed was read (budget/forecast_before_hero.json.gz), whose interval holds the mean of
the hero's committed seeds (the first ladder's tarball: the hero's spec is the same)."""

from __future__ import annotations

import gzip
import json
import math
import tarfile
from pathlib import Path

import pytest

from analysis.forecast.hero import forecast as hero_forecast
from core.rundir import RunDir
from core.spec import load_spec
from ladder.commands.forecast import finished_rungs
from ladder.experiment import load_experiment
from tests.support import FIT_ATOL, FIT_RTOL
from tests import cli_fork

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "h200_ladder"
EXPERIMENT = ROOT / "experiments" / "proxy_h200.py"


@pytest.fixture(scope="module")
def budget_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("budget")
    with tarfile.open(RESULTS / "budget_rungs.tar.gz") as tar:
        tar.extractall(root / "runs", filter="data")
    return root


def _runs(root: Path) -> dict[str, RunDir]:
    return {p.name.rsplit("-", 1)[0]: RunDir(p) for p in sorted((root / "runs" / "proxy_h200").iterdir())}


def test_the_committed_rungs_are_the_experiment_as_declared(budget_root):
    exp = load_experiment(EXPERIMENT)
    runs = _runs(budget_root)
    assert sorted(runs) == sorted(s.name for s in exp.rungs)
    for spec in exp.rungs:
        rd = runs[spec.name]
        assert load_spec(rd.spec_path).id == spec.id == rd.path.name.rsplit("-", 1)[1]
        assert rd.read_status()["state"] == "finished"
        assert [r["step"] for r in rd.read_metrics(warn=None)] == list(range(spec.total_steps))


def test_every_rung_trains_at_the_heros_batch_and_lr_rule():
    exp = load_experiment(EXPERIMENT)
    for s in exp.rungs:
        assert s.data.tokens_per_step == exp.hero.data.tokens_per_step, s.name
        assert math.isclose(s.optim.peak_lr * s.model.d_model ** 0.5, exp.hero.optim.peak_lr * exp.hero.model.d_model ** 0.5)


def test_no_rung_read_a_token_twice():
    plan = json.loads((RESULTS / "budget" / "plan.json").read_text())
    rungs = {s.name for s in load_experiment(EXPERIMENT).rungs}
    rows = [r for r in plan["rungs"] if r["name"] in rungs]
    assert {r["name"] for r in rows} == rungs
    for r in rows:
        assert set(r["data"]["basis"].values()) == {"shards"}
        assert all(0 < e <= 1.0 for e in r["data"]["epochs"].values()), (r["name"], r["data"]["epochs"])


@pytest.fixture(scope="module")
def forecast(budget_root) -> dict:
    out = cli_fork.ladder("forecast", EXPERIMENT, "--root", budget_root, "--no-tracking", "--json", cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((budget_root / "analysis" / "proxy_h200" / "forecast.json").read_text())


def test_the_forecast_reproduces_from_the_committed_rungs(forecast):
    want = json.loads(gzip.open(RESULTS / "budget" / "forecast_before_hero.json.gz").read())
    assert forecast["law"]["kind"] == want["law"]["kind"] == "size_tokens"
    for key in ("mean", "lo", "hi"):
        assert math.isclose(forecast["hero"]["final_loss"][key], want["hero"]["final_loss"][key], rel_tol=FIT_RTOL)
    for key in ("E", "A", "B", "alpha", "beta"):
        assert math.isclose(forecast["law"][key], want["law"][key], rel_tol=1e-6, abs_tol=FIT_ATOL)
    assert [b["held_out"] for b in forecast["law"]["nearest_backtest"]] == [b["held_out"] for b in want["law"]["nearest_backtest"]]


def test_the_forecasts_interval_holds_the_mean_of_the_heros_committed_seeds(forecast, tmp_path):
    """The hero's spec is the first ladder's: its seeds 0-3 there are the truth this forecast is judged by."""
    hero_id = load_experiment(EXPERIMENT).hero.id
    with tarfile.open(RESULTS / "h200_ladder.tar.gz") as tar:
        tar.extractall(tmp_path / "runs", filter="data")
    finals = []
    for rd in (RunDir(p) for p in (tmp_path / "runs" / "proxy_h200").iterdir()):
        spec = load_spec(rd.spec_path)
        if spec.role == "hero" and spec.replace(seed=0).id == hero_id:
            finals.append([r["eval_loss"] for r in rd.read_metrics(warn=None) if r.get("eval_loss") is not None][-1])
    assert len(finals) == 4
    mean = sum(finals) / len(finals)
    fl = forecast["hero"]["final_loss"]
    assert fl["lo"] <= mean <= fl["hi"]


def test_the_regime_check_finds_the_budget_ladder_in_the_heros_regime(forecast):
    assert forecast["regime"]["warnings"] == []
    assert forecast["hero"]["final_loss"]["regime_ok"] is True


def test_a_grid_too_small_for_the_law_of_size_and_tokens_says_so_and_fits_the_envelope(budget_root):
    exp = load_experiment(EXPERIMENT)
    rungs, _ = finished_rungs(budget_root, exp)
    five = [r for r in rungs if r.spec.name not in ("d384-t9", "d384-t12", "d384-t6-seed1")]
    fc = hero_forecast(exp.name, five, exp.hero).to_dict()
    assert fc["law"]["kind"] == "compute"
    assert any("L(N, D) needs at least 6 families and the ladder has 5" in w for w in fc["warnings"])
