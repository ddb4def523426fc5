"""The regime check (analysis.forecast.regime) on the committed H200 ladders and on planted curves:
the first ladder's rungs straddle the loss-slope transition and sit on one tokens-per-parameter line;
the redesigned ladder's rungs all end past it at several budgets per size."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.forecast import regime
from analysis.forecast.rungs import RungRun, final_law
from core import costs
from ladder.commands.forecast import finished_rungs
from ladder.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "h200_ladder"
STRADDLE = ROOT / "experiments" / "proxy_h200_straddle.py"
BUDGET = ROOT / "experiments" / "proxy_h200.py"


def _rungs(tmp_path_factory, tarball: str, experiment: Path) -> list[RungRun]:
    root = tmp_path_factory.mktemp(tarball.split(".")[0])
    with tarfile.open(RESULTS / tarball) as tar:
        tar.extractall(root / "runs", filter="data")
    rungs, missing = finished_rungs(root, load_experiment(experiment))
    assert not missing
    return rungs


@pytest.fixture(scope="module")
def old(tmp_path_factory) -> list[RungRun]:
    return _rungs(tmp_path_factory, "h200_ladder.tar.gz", STRADDLE)


@pytest.fixture(scope="module")
def new(tmp_path_factory) -> list[RungRun]:
    return _rungs(tmp_path_factory, "budget_rungs.tar.gz", BUDGET)


def _kinds(warnings) -> dict[str, regime.RegimeWarning]:
    assert all(w.kind in regime.KINDS for w in warnings)
    return {w.kind: w for w in warnings}


def _curve(tokens, t0: float | None, drop: float = 0.4, width: float = 0.4, noise: float = 0.01, seed: int = 0):
    """A power law L = 12 T^-0.3 (in Mtokens), times a sigmoid drop of `drop` in ln L centred at t0
    over `width` in ln T (its slope bump peaks drop/(4 width) above 0.3), with per-step noise."""
    t = np.asarray(tokens, dtype=np.float64)
    lnl = np.log(12.0) - 0.3 * np.log(t / 1e6)
    if t0 is not None:
        lnl -= drop / (1 + np.exp(-(np.log(t) - np.log(t0)) / width))
    return np.exp(lnl + noise * np.random.default_rng(seed).standard_normal(t.size))


def _planted(t0: float | None, finals: dict[str, float] | None = None) -> list[RungRun]:
    """RungRuns of the first ladder's declared seed-0 rungs whose train curves are _curve(t0) and whose
    final eval losses are `finals` (default: the curve's last value), each with a 0.5% standard error."""
    out = []
    for i, spec in enumerate(s for s in load_experiment(STRADDLE).rungs if s.seed == 0):
        step = np.arange(spec.total_steps + 1)
        tokens = (step + 1) * spec.data.tokens_per_step
        loss = _curve(tokens, t0, seed=i)
        final = finals[spec.name] if finals else float(loss[-1])
        ev = np.full(step.size, np.nan)
        ev[-1] = final
        flag = np.full(step.size, np.nan, dtype=object)
        flag[-1] = True
        m = pd.DataFrame({"step": step, "tokens": tokens, "loss": loss, "eval_loss": ev, "extra.eval_final": flag,
                          "extra.eval_loss_se": np.where(np.isfinite(ev), 0.005 * final, np.nan)})
        out.append(RungRun(spec, Path(spec.name), m))
    return out


def test_old_ladder_names_d192_before_and_d256_inside_the_transition(old):
    """d192 (both seeds) ends at 8.6M tokens with no bump while d320/d384 peak near 25M; d256-seed1 ends at
    20M mid-bump (its slope 0.40, baseline 0.18), the seed 12% below its sibling d256, which has not begun it."""
    w = _kinds(regime.regime_check(old))
    assert {"d192", "d192-seed1", "d256"} <= set(w["ends_before_transition"].runs)
    assert "d256-seed1" in w["ends_inside_transition"].runs
    assert "d192 ends at 8.63M tokens" in w["ends_before_transition"].message


def test_old_ladder_d320_is_not_back_from_its_bump(old):
    """d320 ends 1.6x past its slope's peak with the slope still 0.45 (its baseline 0.21): inside, not past."""
    assert {"d320", "d320-seed1"} <= set(_kinds(regime.regime_check(old))["ends_inside_transition"].runs)


def test_old_ladder_size_is_not_identified(old):
    w = _kinds(regime.regime_check(old))["size_not_identified"]
    assert set(w.runs) == {"d192", "d256", "d320", "d384"} and "6 tokens per active parameter" in w.message


def test_old_ladder_steepening_is_within_its_seed_noise(old):
    """Its slopes go 0.21 -> 0.25 -> 0.24, but the d256 seeds 12% apart make the pooled seed spread 4.4%
    per run: the step up is 0.6 standard errors, so the rule (rightly) does not call it beyond noise."""
    assert "final_slopes_steepen" not in _kinds(regime.regime_check(old))


def test_old_ladder_law_falls_faster_in_tokens_than_its_largest_rung(old):
    """Along the 6 tokens-per-parameter line C grows as T^2: the fitted law's -dlnL/dlnT at the hero is
    2 x 0.228 = 0.46, while d384's own curve falls at 0.36 late in its run."""
    hero = load_experiment(STRADDLE).hero
    C, fit = costs.total_flops(hero), final_law(old).fit
    slope_c = -np.log(fit.predict(C * 1.01)["loss"] / fit.predict(C / 1.01)["loss"]) / np.log(1.01 ** 2)
    w = _kinds(regime.regime_check(old, law_slope=2 * float(slope_c), law_label="hero-d512"))
    assert set(w["law_steeper_than_curve"].runs) == {"d384", "d384-seed1"}


def test_new_ladder_has_no_regime_warning(new):
    """Every rung ends >= 2x past its slope's peak with the excess at most 0.41 of its peak; three sizes at
    3 to 12 tokens per active parameter; the best-loss envelope's slopes flatten (0.42, 0.28, 0.10)."""
    assert regime.regime_check(new) == []


def test_planted_transition_is_found_where_planted():
    """Peak at the planted centre; its excess near the planted drop/(4 width) = 0.25, less the ~20% that the
    bin smoothing and a baseline window reaching into the bump's rise take off."""
    t = np.arange(1, 3001) * 65536.0
    tr = regime.find_transition(t, _curve(t, 30e6), min_tokens=30 * 65536)
    assert tr is not None and 0.8 < tr.peak_tokens / 30e6 < 1.25
    assert 0.15 < tr.excess < 0.3 and tr.baseline == pytest.approx(0.3, abs=0.05)
    assert tr.ended_tokens is not None and tr.ended_tokens < t[-1]


def test_power_law_curves_have_no_transition():
    t = np.arange(1, 3001) * 65536.0
    assert all(regime.find_transition(t, _curve(t, None, seed=s), min_tokens=30 * 65536) is None for s in range(5))


def test_planted_transition_warns_the_rungs_before_and_inside_it():
    w = _kinds(regime.regime_check(_planted(25e6)))
    assert set(w["ends_before_transition"].runs) == {"d192"}
    assert set(w["ends_inside_transition"].runs) == {"d256", "d320"}


def test_power_law_rungs_get_no_transition_warning():
    w = _kinds(regime.regime_check(_planted(None)))
    assert not {"ends_before_transition", "ends_inside_transition", "law_steeper_than_curve"} & set(w)


def test_final_slopes_steepening_beyond_noise_warn():
    C = {s.name: costs.total_flops(s) for s in load_experiment(STRADDLE).rungs if s.seed == 0}
    lnc = np.log([C[n] for n in ("d192", "d256", "d320", "d384")])
    lnl = 1.5 - np.cumsum([0.0, *(np.diff(lnc) * [0.15, 0.25, 0.35])])  # slopes 0.15 -> 0.25 -> 0.35
    finals = dict(zip(("d192", "d256", "d320", "d384"), np.exp(lnl)))
    w = _kinds(regime.regime_check(_planted(None, finals)))["final_slopes_steepen"]
    assert "no E >= 0" in w.message and set(w.runs) <= set(finals)


def test_final_slopes_flattening_do_not_warn():
    C = {s.name: costs.total_flops(s) for s in load_experiment(STRADDLE).rungs if s.seed == 0}
    lnc = np.log([C[n] for n in ("d192", "d256", "d320", "d384")])
    lnl = 1.5 - np.cumsum([0.0, *(np.diff(lnc) * [0.35, 0.25, 0.15])])
    finals = dict(zip(("d192", "d256", "d320", "d384"), np.exp(lnl)))
    assert "final_slopes_steepen" not in _kinds(regime.regime_check(_planted(None, finals)))


def test_law_slope_within_margin_of_the_late_curve_does_not_warn():
    rungs = _planted(None)
    late = regime.late_slope(max(rungs, key=lambda r: r.flops))
    assert late == pytest.approx(0.3, abs=0.03)
    assert "law_steeper_than_curve" not in _kinds(regime.regime_check(rungs, law_slope=late + 0.8 * regime.LAW_MARGIN))
    assert "law_steeper_than_curve" in _kinds(regime.regime_check(rungs, law_slope=late + 2 * regime.LAW_MARGIN))


def test_warning_to_dict_is_plain():
    d = regime.RegimeWarning("size_not_identified", "m", ("a", "b")).to_dict()
    assert d == {"kind": "size_not_identified", "message": "m", "runs": ["a", "b"]}
