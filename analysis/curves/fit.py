"""Schedule-aware models of a whole loss curve: L(t) given the learning-rate schedule up to step t,
fitted to one or several curves (optionally of several model sizes) and used to predict the curve
under a schedule, or at a model size, that the fit never saw.

Models
------
"mpl": the Multi-Power Law (Luo et al. 2025, "A Multi-Power Law for Loss Curve Prediction Across
Learning Rate Schedules"), in the form of their reference code:

    L(t)  = L0 + A * S1(t)^-alpha - LD(t)
    S1(t) = sum_{tau<=t} eta_tau                      (the warmup's area included: S1 + S_W)
    LD(t) = B * sum_{k=1..t} (eta_{k-1} - eta_k) * G(eta_k^-gamma * S_k(t)),  S_k(t) = sum_{tau=k..t} eta_tau
    G(x)  = 1 - (C x + 1)^-beta

Every LR change counts in LD, the warmup's increases too (as in the published fits): after warmup
their share settles to a constant and a slowly fading term that the fit absorbs.

"lra": the baseline of Tissue et al. 2024 ("Scaling Law with Learning Rate Annealing"):

    L(t) = L0 + A * S1(t)^-alpha - C * S2(t),  S2(t) = sum_{i<=t} m_i,  m_i = lam * m_{i-1} + (eta_{i-1} - eta_i)

with their momentum lam = 0.999 (fixed) and only post-warmup LR changes in S2.

Fitting: a Huber loss on log(loss) - log(pred), summed over every point of every curve (as in the
published fit), minimised by L-BFGS-B with analytic gradients. The Multi-Power Law is fitted in two
stages. Stage 1 fits the 'instant' model L0 + A S1^-alpha + B eta_t (every LR change fully felt at
once, G = 1; the published fit starts from the same linearised model) from a small grid; its B is
the loss's settled sensitivity to the LR. Stage 2 fits L0, A, alpha, C, beta, gamma with B held
there, from a few starts. B and the slow tail of G trade off (a larger B with a slower-saturating
G fits the few thousand steps after an LR drop as well as a smaller B with a quicker one), and the
one-stage optimum, taking the larger B, over-predicts the gain of long decays (72k-step cosine);
`joint=True` gives that one-stage fit. gamma is kept in [0.01, 1]: the recovery clock after an LR
drop runs between LR area (gamma = 0) and step count (gamma = 1). The Huber threshold is 1e-2 on
log loss, not the published 1e-3: at 1e-3 the steep first points after warmup count as outliers and
their misfit (~1%) reappears in every predicted curve; at 1e-2 sub-percent residuals are fitted in
the least-squares way and loss spikes still count only linearly.

Speed: LD over all logged steps is O(T x n) exactly (19M terms for a 72k-step cosine logged every
128 steps). Here the LR changes far behind an evaluated step are lumped: changes within DENSE_STEPS
steps of t enter one by one, older ones in blocks whose width grows geometrically with the distance
(ratio BLOCK_RATIO), each block a single change at its |change|-weighted mean log-LR and position.
G is smooth there, so the error stays near 1e-5 of the loss (tests compare with the exact sum) while a
72k-step curve costs ~100 terms per evaluated step; a fit takes about a second.

Model size: curves may carry `params` (N, the model's parameter count). With several sizes the
curves share every parameter but the floor, L0(N) = E + a (N/N_ref)^-p (p fixed at CHINCHILLA_ALPHA
with two sizes, fitted with three or more): Chinchilla's additive form, in which the data term does
not depend on N (size_law="additive", the default). size_law="slopes" also lets log A, log alpha and
log B move linearly in log N. On the CPU ladder's rungs (four splits: two or three rungs predicting
the next, all four predicting the hero) the additive law erred 6.5-8.7% where the slopes erred
8.4-22% (and once diverged): their extra parameters are extrapolated, not measured.
With ONE size there is nothing to learn the scaling from, so predicting another size uses a prior
(stated here, reported by `CurveFit.to_dict`, chosen by `size_prior`):
- "kaplan-floor" (default): Kaplan et al. (2020)'s L(N) = (N_c / N)^0.076 describes the loss of a
  model trained to convergence, which is the curve's floor L0 (its limit at infinite LR area); so
  L0(N) = L0 (N / N_fit)^-0.076 and the data term is left as fitted (in Chinchilla's additive form it
  does not depend on N). When the fit leaves L0 on a bound of its range (short curves do not measure
  their floor), the whole curve scales as under "kaplan" instead;
- "kaplan": the whole curve scales as (N / N_fit)^-0.076, a relative change that needs no floor;
- "chinchilla": Chinchilla's L(N) = E + A_N/N^0.34 (Hoffmann et al. 2022: E 1.69, A_N 406.4, alpha 0.34),
  rescaled to pass through the fitted L0 at the fitted size, gives L0(N); A, alpha, B, C, beta, gamma
  are kept (in Chinchilla's additive form the data term does not depend on N).
The two published laws disagree by about 0.03 in relative loss per e-fold of N near 1e8 parameters
(Kaplan's slope 0.076, Epoch's refit of Chinchilla ~0.11 there); a band at another size adds that
(SIZE_PRIOR_SD per e-fold, as a relative sd of the floor under "kaplan-floor", of the whole loss
otherwise) in quadrature. bench/forecast_backtest.py measures the three priors on every dataset
(multipower 25M <-> 100M, and each ladder rung predicting the next size up) and docs/results/forecast-backtests.md reports it.

Bands (`CurveFit.band`): the training residuals' relative scatter, the bootstrap refits' spread, an
extrapolation term in LR area and, at another size, the size term, added in quadrature. The size term
is measured wherever the fit has several sizes: each size beyond the smallest is predicted from the
smaller sizes' curves (one size: its prior; several: their size law), and the root mean square of the
held-out curves' mean relative errors per e-fold of N is the term's sd per e-fold beyond the fitted
sizes, its half-width at Student's t quantile for the number of held-out sizes (1 for two sizes). From
two held-out sizes on (three fitted sizes) the band takes the size term per stretch of the run instead
(analysis.curves.sizeband: the held-out curves' |mean relative error| per stretch and e-fold of N, its
split-conformal quantile), in place of the bootstrap spread and the LR-area term. With
one size nothing measures it: the prior's SIZE_PRIOR_SD (the published laws' disagreement) stands, and
the band says little across sizes. The
non-bootstrap parts are scaled by a calibration factor measured leave-one-curve-out on the training
curves (refit without each curve, predict it: the factor makes `level` of the held-out points fall
inside). With a single curve there is nothing to leave out, the factor is 1 and a warning says so.

Warnings (`CurveFit.warnings`): parameters on a bound of their search range (`converged` is then
False), a fit of fewer than three sizes that predicts another size, an uncalibrated band, bootstrap
refits that disagree wildly.

Learning rates: see analysis.curves.data (one value per logged step, or a dense per-step array).

Modules: curve_data (curves and schedules), curve_design (schedule features and the models'
predictions), curve_sizelaw (size law and one-size priors), curve_optim (objective, starts, L-BFGS),
curve_fit (the fitted model: prediction at any size, band, JSON), this one (the fit, its bootstrap,
calibration and warnings).

Shape legend: n evaluated steps, T steps of a dense schedule, b lumped LR-change blocks per step,
P model parameters (7 mpl / 4 lra), Z fitted coordinates (P plus the size-law terms), K bootstrap draws.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np
from scipy.stats import norm

from analysis import fitwarn
from analysis.curves.data import Curve, CurveError, CurveFitError, lr_per_step_from_samples
from analysis.curves.design import GAMMA_MAX, LOG_BOUNDS, MODELS, Design
from analysis.curves.fitted import CurveFit
from analysis.curves.optim import bounds_for, clip_to, fit_one_size, fix_bound, lbfgs, linearised_start, sized_start
from analysis.curves.sizeband import stretch_scores
from analysis.curves.sizelaw import KAPLAN_ALPHA_N, SIZE_LAWS, SIZE_PRIOR_SD, SIZE_PRIORS, SizeLaw

try:  # a transitive dependency (scikit-learn via mlflow); without it the fit is only slower
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

__all__ = [
    "Curve",
    "CurveError",
    "CurveFit",
    "CurveFitError",
    "GAMMA_MAX",
    "KAPLAN_ALPHA_N",
    "MODELS",
    "SIZE_PRIORS",
    "fit_curves",
    "lr_per_step_from_samples",
    "relative_errors",
]

CALIB_MIN, CALIB_MAX = 0.5, 10.0  # the band's calibration factor is kept in this range


def relative_errors(pred, loss) -> dict[str, float]:
    e = np.abs(np.asarray(pred, dtype=np.float64) - np.asarray(loss, dtype=np.float64)) / np.asarray(loss, dtype=np.float64)
    return {"mean_rel_err": float(e.mean()), "max_rel_err": float(e.max()), "n": int(len(e))}


def _block_weights(n: int, rng: np.random.Generator, block: int = 8) -> np.ndarray:
    nb = -(-n // block)
    counts = rng.multinomial(nb, np.full(nb, 1.0 / nb))
    return np.repeat(counts, block)[:n].astype(np.float64)


def fit_curves(
    curves: Sequence[Curve],
    model: str = "mpl",
    *,
    n_boot: int = 0,
    seed: int = 0,
    joint: bool = False,
    exact: bool = False,
    size_prior: str = "kaplan-floor",
    calibrate: bool | None = None,
    level: float = 0.9,
    size_law: str = "additive",
    floor_law: tuple[float, float] | None = None,
) -> CurveFit:
    """Fit `model` ("mpl" or "lra") to `curves` with shared parameters (a size law across sizes when
    the curves carry several `params` values). n_boot > 0 adds block-bootstrap refits for bands.
    joint=True fits the Multi-Power Law's B together with the rest (one stage) instead of from the
    instant model; exact=True evaluates LD term by term (slow; for checking the lumping).
    size_law: "additive" (several sizes: only L0 = E + a N^-p moves with N) or "slopes" (log A, log alpha,
    log B linear in log N too). size_prior: "kaplan-floor", "kaplan" or "chinchilla", how a one-size fit predicts another size. calibrate (default:
    with n_boot > 0) measures the band's calibration factor leave-one-curve-out at `level`.
    floor_law: (E, p), the floor's size law L0(N) = E + a (N/N_ref)^-p held there instead of fitted
    (curves of three or more sizes), e.g. from a ladder's compute law (analysis.forecast.hero.floor_law).
    Raises CurveError for unusable input, CurveFitError when the fit does not converge."""
    if size_law not in SIZE_LAWS:
        raise CurveError(f"unknown size law {size_law!r}; choose one of {', '.join(SIZE_LAWS)}")
    if size_prior not in SIZE_PRIORS:
        raise CurveError(f"unknown size prior {size_prior!r}; choose one of {', '.join(SIZE_PRIORS)}")
    if not 0 < level < 1:
        raise CurveError(f"level must be in (0, 1), got {level}")
    calibrate = n_boot > 0 if calibrate is None else calibrate
    # L-BFGS-B makes thousands of tiny BLAS calls; a multi-threaded BLAS spins its threads on each
    # one and on a busy machine runs many times slower than one thread.
    if threadpool_limits is None:
        fit = _fit_curves(curves, model, n_boot, seed, joint, exact, size_law, floor_law)
        return _finish(fit, curves, model, joint, size_prior, calibrate, level)
    with threadpool_limits(limits=1, user_api="blas"):
        fit = _fit_curves(curves, model, n_boot, seed, joint, exact, size_law, floor_law)
        return _finish(fit, curves, model, joint, size_prior, calibrate, level)


def _finish(fit: CurveFit, curves, model, joint, size_prior, calibrate, level) -> CurveFit:
    """The size prior, the band's calibration and the warnings."""
    fit.size_prior = size_prior
    fit.sizes = list(fit.info.get("sizes") or [])
    if fit.law_kind == "none":
        fit.warnings.append("one training size: a prediction at another size rests on the "
                            f"{size_prior} prior (analysis.curves.fit), not on this data")
    elif fit.law_kind == "two":
        fit.warnings += fitwarn.too_few_sizes(2, "sizes for the size law")
    if fit.law_kind != "none" and len(set(fit.sizes)) >= 2:
        fit.size_sd, fit.size_backtest = _size_backtest(fit, list(curves), model, joint, size_prior)
        if fit.size_sd is None:
            fit.warnings.append(f"size term not backtested ({fit.size_backtest.get('why')}): the band beyond the "
                                f"fitted sizes uses the prior {SIZE_PRIOR_SD} per e-fold of N")
        elif fit.size_backtest.get("sizes_held_out", 0) < 2:
            fit.warnings.append("the band's size term rests on one held-out size (the larger predicted from the "
                                "smaller): beyond the fitted sizes it is a one-point estimate")
    if calibrate:
        fit.calib, fit.calibration = _calibrate(fit, list(curves), model, joint, size_prior, level)
        if fit.calibration.get("n_points", 0) == 0:
            fit.warnings.append(f"band not calibrated: {fit.calibration.get('why', 'no curve could be left out')}")
    if fit.boot_z is not None and len(fit.boot_z) >= 4:
        nat = np.array([_natural_row(fit.names, z) for z in fit.boot_z])
        ci = {k: list(np.quantile(nat[:, i], [0.05, 0.95])) for i, k in enumerate(fit.names)}
        pos = [k for k in fit.names if k in LOG_BOUNDS or k in ("a", "p")]
        fit.warnings += fitwarn.bootstrap_disagreement(ci, len(fit.boot_z), 0, positive=pos)
    fit.info["converged"] = fit.converged
    return fit


def _bound_warnings(names, z, bounds) -> list[str]:
    """Parameters on a bound of their search range, in natural units (fixed ones left out)."""
    out = []
    for k, v, (lo, hi) in zip(names, z, bounds):
        if lo is not None and hi is not None and lo >= hi:
            continue
        logged = k in LOG_BOUNDS or k in ("a", "p")
        nat = (lambda x: math.exp(x)) if logged else (lambda x: x)
        w = fitwarn.at_bounds({k: v}, {k: (lo, hi)})
        if w:
            side = "lower" if "lower" in w[0] else "upper"
            b = lo if side == "lower" else hi
            out.append(f"{k} = {nat(v):.4g} is at its {side} bound {nat(b):.4g}: the optimum may lie beyond it")
    return out


def _natural_row(names, z) -> list[float]:
    return [float(math.exp(v)) if k in LOG_BOUNDS or k in ("a", "p") else float(v) for k, v in zip(names, z)]


def _size_backtest(fit: CurveFit, curves, model, joint, size_prior) -> tuple[float | None, dict]:
    """The size term from the fit's own sizes: each size beyond the smallest predicted from the curves of
    the smaller sizes (one size: its prior; several: their size law), told only N and the schedule. A
    held-out curve's error is its mean relative error (the level the size sets; the schedule's own
    scatter is the band's other terms), per e-fold of N beyond the largest smaller size:
    size_sd^2 = mean over held-out curves of (mean error / e-folds)^2."""
    sizes = sorted({c.params for c in curves if c.params is not None})
    obs, rows = [], []
    for k in range(1, len(sizes)):
        fitted = [c for c in curves if c.params is not None and c.params < sizes[k]]
        held = [c for c in curves if c.params == sizes[k]]
        try:
            floor = fit.info.get("floor_law")
            floor = (floor["E"], floor["p"]) if floor and len({c.params for c in fitted}) >= 3 else None
            sub = _fit_curves(fitted, model, 0, 0, joint, False, fit.size_law, floor)
            sub.size_prior, sub.sizes = size_prior, list(sub.info.get("sizes") or [])
        except CurveError:
            continue
        rho = math.log(sizes[k] / sizes[k - 1])
        for c in held:
            pred = sub.predict_curve(c)
            e = float(np.mean(pred / c.loss - 1.0))
            if math.isfinite(e):
                obs.append((e / rho) ** 2)
                rows.append({"curve": c.name, "size": sizes[k], "from_sizes": sizes[:k], "mean_rel_error": e,
                             "efolds": rho, "stretch_scores": stretch_scores(c.step, pred, c.loss, rho)})
    if not obs:
        return None, {"why": "no size could be predicted from smaller ones"}
    sd = float(math.sqrt(np.mean(obs)))
    return sd, {"method": "each size beyond the smallest from the smaller sizes' curves; size_sd = root mean "
                "square over held-out curves of (mean relative error / e-folds of N); the band uses stretch_scores "
                "(analysis.curves.sizeband: |mean relative error| per stretch of the run / e-folds of N)", "size_sd": sd,
                "sizes_held_out": len(sizes) - 1, "curves": rows}


def _calibrate(fit: CurveFit, curves, model, joint, size_prior, level) -> tuple[float, dict]:
    """Leave-one-curve-out: refit without each curve (no bootstrap), predict it with that fit's
    non-bootstrap sd; the factor is the `level` quantile of |error| / sd over the held-out points,
    divided by the normal quantile, kept in [CALIB_MIN, CALIB_MAX]. A curve that is its size's only
    one is not left out (that would test the size law, not the schedule model)."""
    if len(curves) < 2:
        return 1.0, {"method": "leave-one-curve-out", "n_points": 0, "why": "one training curve, none to leave out"}
    zq = float(norm.ppf(0.5 + level / 2))
    ratios = []
    for i, c in enumerate(curves):
        rest = curves[:i] + curves[i + 1:]
        if c.params is not None and c.params not in {x.params for x in rest}:
            continue
        try:
            floor = fit.info.get("floor_law")
            floor = (floor["E"], floor["p"]) if floor else None
            sub = _fit_curves(rest, model, 0, 0, joint, False, fit.size_law, floor)
            designs = [Design(model, x.step, x.lr_per_step) for x in rest]
            sub.extrap_rel = _backtest_extrapolation(rest, designs, model, joint, fit.size_law, floor)
            sub.size_prior, sub.sizes = size_prior, list(sub.info.get("sizes") or [])
            pred = sub.predict_curve(c)
        except CurveError:
            continue
        sd = np.sqrt(sub._model_var(c.step, c.lr_per_step, c.params, pred) + sub._size_var(c.params, pred))
        ok = sd > 0
        ratios.append(np.abs(c.loss[ok] - pred[ok]) / sd[ok])
    if not ratios:
        why = "every curve is its size's only one" if fit.law_kind != "none" else "no refit succeeded"
        return 1.0, {"method": "leave-one-curve-out", "n_points": 0, "why": why}
    r = np.concatenate(ratios)
    k = float(np.clip(np.quantile(r, level) / zq, CALIB_MIN, CALIB_MAX))
    return k, {"method": "leave-one-curve-out", "n_curves": len(ratios), "n_points": int(len(r)), "level": level,
               "factor": k, "coverage_uncalibrated": float(np.mean(r <= zq))}


def _fit_curves(curves, model, n_boot, seed, joint, exact, size_law="additive", floor_law=None) -> CurveFit:
    t0 = time.perf_counter()
    if model not in MODELS:
        raise CurveError(f"unknown curve model {model!r}; choose one of {', '.join(MODELS)}")
    curves = list(curves)
    if not curves:
        raise CurveError("no curves to fit")
    for i, c in enumerate(curves):
        if not isinstance(c, Curve):
            raise CurveError(f"curve {i}: expected a Curve, got {type(c).__name__}")
        if c.loss is None:
            raise CurveError(f"curve {c.name or i}: has no loss to fit")
    has_n = [c.params is not None for c in curves]
    if any(has_n) and not all(has_n):
        missing = [c.name or str(i) for i, c in enumerate(curves) if c.params is None]
        raise CurveError(f"params (model size) given for some curves but not for {', '.join(missing)}")
    sizes = sorted({c.params for c in curves}) if all(has_n) else []
    kind = "none" if len(sizes) <= 1 else ("two" if len(sizes) == 2 else "many")
    log_nref = float(np.mean(np.log(sizes))) if sizes else 0.0
    law = SizeLaw(model, kind, log_nref, SIZE_LAWS[size_law])
    n_points = sum(len(c.step) for c in curves)
    n_free = len(law.names)
    if model == "mpl" and not joint:
        n_free -= 1 if kind == "none" or "B" not in law.scaled else 2  # B (and its slope) from the instant model
    if n_points <= n_free:
        raise CurveError(f"{n_points} points in all, but the {model} fit has {n_free} parameters: need more points")

    designs = [Design(model, c.step, c.lr_per_step, exact=exact) for c in curves]
    ys = [c.loss for c in curves]
    log_ns = [math.log(c.params) if c.params is not None else None for c in curves]
    y_min = min(float(y.min()) for y in ys)
    eta_ref = max(float(c.lr_per_step[: c.step[-1] + 1].max()) for c in curves)

    if kind == "none":
        best, results, bounds = fit_one_size(model, designs, ys, None, eta_ref, y_min, joint=joint)
        fixed = {}
    else:
        # one fit per size seeds the size law; B and its slope in log N come from those fits
        thetas = []
        for n in sizes:
            idx = [i for i, c in enumerate(curves) if c.params == n]
            r, _, _ = fit_one_size(model, [designs[i] for i in idx], [ys[i] for i in idx], None, eta_ref,
                                    min(float(ys[i].min()) for i in idx), joint=joint)
            thetas.append(r.x)
        z0 = sized_start(thetas, [math.log(n) for n in sizes], law)
        bounds = bounds_for(law, y_min)
        if floor_law is not None:
            if kind != "many":
                raise CurveError(f"a given floor law needs curves of three or more sizes, got {len(sizes)}")
            E, p = float(floor_law[0]), float(floor_law[1])
            if not (math.isfinite(E) and math.isfinite(p) and 0 <= E < y_min and p > 0):
                raise CurveError(f"floor law E={E:g}, p={p:g}: need 0 <= E < the lowest loss ({y_min:g}) and p > 0")
            bounds = fix_bound(fix_bound(bounds, law.names.index("E"), E), law.names.index("p"), math.log(p))
        fixed = {}
        if model == "mpl" and not joint:
            for name in [n for n in ("B", "s_B") if n in law.names]:
                i = law.names.index(name)
                fixed[i] = float(z0[i])
                bounds = fix_bound(bounds, i, float(z0[i]))
        args = (designs, ys, log_ns, law, [None] * len(ys))
        results = [lbfgs(clip_to(z0, bounds), args, bounds)]
        best = results[0]
    if not np.all(np.isfinite(best.x)) or not np.isfinite(best.fun) or best.fun >= 1e29:
        raise CurveFitError(f"the {model} curve fit did not converge (no finite solution)")
    converged = any(r.success for r in results if abs(r.fun - best.fun) <= 1e-6 * max(abs(best.fun), 1e-12))
    if not converged:
        raise CurveFitError(f"the {model} curve fit did not converge: {best.message}")

    fit = CurveFit(model=model, names=law.names, z=best.x, law_kind=kind, log_nref=log_nref,
                   size_n=sizes[0] if len(sizes) == 1 else None, size_law=size_law)
    fit.warnings += _bound_warnings(law.names, best.x, bounds)
    fit.converged = not fit.warnings
    fit.floor_free = not any(w.startswith(("L0 =", "E =")) for w in fit.warnings)
    rel = []
    per_curve = []
    for c, des, log_n in zip(curves, designs, log_ns):
        pred = des.predict(law.theta(best.x, log_n)[0])
        if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
            raise CurveFitError(f"the {model} curve fit did not converge: non-finite or non-positive predictions")
        rel.append((c.loss - pred) / c.loss)
        per_curve.append({"name": c.name, **relative_errors(pred, c.loss)})
    rel_all = np.concatenate(rel)
    fit.resid_rel_std = float(1.4826 * np.median(np.abs(rel_all - np.median(rel_all))))
    mean_err = float(np.mean(np.abs(rel_all)))
    if mean_err > 0.1:
        raise CurveFitError(
            f"the {model} curve fit cannot describe these curves (mean relative training error {100 * mean_err:.1f}%)"
        )

    fit.s1_max = float(max(math.exp(d.logS1_n[-1]) for d in designs))
    if n_boot > 0:
        fit.boot_z = _bootstrap(model, law, best.x, bounds, designs, ys, log_ns, eta_ref, n_boot, seed, joint)
        fit.extrap_rel = _backtest_extrapolation(curves, designs, model, joint, size_law, floor_law)

    fit.info = {
        "objective": float(best.fun),
        "n_points": n_points,
        "n_curves": len(curves),
        "sizes": sizes,
        "iterations": int(best.nit),
        "converged": fit.converged,
        **({"floor_law": {"E": float(floor_law[0]), "p": float(floor_law[1])}} if floor_law is not None else {}),
        "train": per_curve,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return fit


def _backtest_extrapolation(curves, designs, model, joint, size_law="additive", floor_law=None) -> float:
    """Relative error per e-fold of LR area when extrapolating: refit on each curve's points up to
    half its final LR area, predict the rest; least squares of |error| against log(S1 / S1_cut)."""
    early, late = [], []
    for c, d in zip(curves, designs):
        cut = d.logS1_n[-1] - math.log(2.0)
        m = d.logS1_n <= cut
        if m.sum() >= 6 and (~m).sum() >= 3:
            early.append(Curve(c.step[m], c.lr_per_step, c.loss[m], params=c.params, name=c.name))
            late.append((c, ~m, d.logS1_n[~m] - cut))
    if not early:
        return 0.0
    try:
        bt = _fit_curves(early, model, 0, 0, joint, False, size_law, floor_law)
    except CurveError:
        return 0.0
    num = den = 0.0
    for c, m, rho in late:
        e = bt.predict(c.step[m], c.lr_per_step, params=c.params) / c.loss[m] - 1.0
        num += float(np.sum(e * e))
        den += float(np.sum(rho * rho))
    return math.sqrt(num / den) if den > 0 else 0.0


def _bootstrap(model, law, z, bounds, designs, ys, log_ns, eta_ref, n_boot, seed, joint) -> np.ndarray | None:
    """Refits on block-resampled points (blocks of 8 consecutive points, as residuals are correlated
    along a curve), each started at the full-data optimum; for the one-size Multi-Power Law B is
    re-estimated from the resampled instant model too."""
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        w = [_block_weights(len(y), rng) for y in ys]
        bnd = bounds
        if model == "mpl" and law.kind == "none" and not joint:
            lin = linearised_start(designs, ys, w)
            lB = float(np.clip(math.log(max(lin[3], 1e-6) / eta_ref), *LOG_BOUNDS["B"]))
            bnd = fix_bound(bounds, 3, lB)
        r = lbfgs(clip_to(z, bnd), (designs, ys, log_ns, law, w), bnd, maxiter=1000)
        if np.all(np.isfinite(r.x)) and r.fun < 1e29:
            boots.append(r.x)
    return np.asarray(boots) if boots else None
