"""What a hero forecast says about itself: the regime check's verdict on its rungs (the interval marked
not to be trusted where it warns) and its two routes to the final loss side by side (the law's and
the curve model's own; the interval widened to hold both where they disagree)."""

from __future__ import annotations

from typing import Any, Sequence

from analysis.forecast import grid, regime
from analysis.forecast.file import ForecastLaw, ForecastRegime, ForecastTrajectory
from core import costs
from core.spec import Spec


def law_token_slope(law: ForecastLaw, hero: Spec) -> float:
    """The law's -dlnL/dln(tokens) at the hero: at its size for L(N, D); along the ladder's line
    (tokens per parameter fixed, so compute grows as tokens squared) for L(C)."""
    if law.kind == "size_tokens":
        N, D = grid.hero_point(hero)
        L = law.E + law.A * N ** -law.alpha + law.B * D ** -law.beta
        return law.beta * law.B * D ** -law.beta / L
    C = costs.total_flops(hero)
    return 2 * law.alpha * law.A * C ** -law.alpha / (law.E + law.A * C ** -law.alpha)


def regime_verdict(rungs: Sequence[Any], hero: Spec, law: ForecastLaw, final: dict) -> ForecastRegime:
    """The regime check on the rungs (analysis.forecast.regime); where it warns, the final-loss interval
    says it is not to be trusted (`ladder forecast --strict` refuses it)."""
    found = regime.regime_check(rungs, law_slope=law_token_slope(law, hero), law_label=law.label)
    final["regime_ok"] = not found
    if found:
        final["caveat"] = ("the rungs are not in the hero's regime (regime.warnings): the interval's coverage is not what "
                           "its backtest says, and the forecast is not to be trusted")
    return ForecastRegime(
        warnings=[w.to_dict() for w in found], kinds=list(regime.KINDS),
        method="analysis.forecast.regime: every rung's local loss slope in tokens (a transition's bump, rungs that "
               "end before or inside it), final-loss slopes against compute, the law's slope in tokens against "
               "the largest rung's late curve, and the ladder's design (one tokens-per-parameter line)")


def routes(final: dict, traj: ForecastTrajectory) -> list[str]:
    """The two routes to the hero's final loss side by side: the law's and the curve model's own (its
    trajectory's end before it was moved onto the law's level, in eval terms). Where the curve model's
    lies outside the law's interval, the interval widens to hold both and a warning says so."""
    rho = traj.train_eval_ratio
    own = (final["mean"] * rho - traj.shift) / rho
    final["routes"] = {"law": final["mean"], "curve_model": own, "rel_difference": own / final["mean"] - 1,
                       "method": "the curve model's hero trajectory ends at curve_model (eval terms, before it is "
                                 "shifted onto the law's level); the interval holds both"}
    if final["lo"] <= own <= final["hi"]:
        return []
    lo, hi = final["lo"], final["hi"]
    final["lo"], final["hi"] = min(lo, own), max(hi, own)
    final["routes"]["widened_from"] = [lo, hi]
    return [f"two routes disagree: the law forecasts {final['mean']:.4f} ({lo:.4f} to {hi:.4f}), the curve model "
            f"{own:.4f} ({100 * (own / final['mean'] - 1):+.1f}%); the interval widens to {final['lo']:.4f} to "
            f"{final['hi']:.4f} to hold both, and the trajectory is the curve model's shifted by {traj.shift:+.4f}"]
