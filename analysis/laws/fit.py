"""Scaling-law fits: L(N, D) = E + A/N^alpha + B/D^beta, the compute envelope L(C) = E + A*C^-alpha,
and an MoE form E + A/N_active^alpha + G/N_total^gamma + B/D^beta; compute-optimal N*, D* for a budget.

All are sums of power terms plus a floor, fitted the way Hoffmann et al. (2022) and Epoch AI's
replication did: in log space,

    log L_hat = LSE(a_1 - alpha_1*log x_1, ..., a_K - alpha_K*log x_K, e)     (A_k = exp a_k, E = exp e)

with a Huber loss (delta 1e-3) on the residual log L_hat - log L, SUMMED over points (with the mean
the objective is ~1e-6 and L-BFGS's tolerances stop it early, the failure Epoch found), minimised by
L-BFGS from a grid of starts.

How it stays fast: the objective and its analytic gradient are vectorised over starts, so the whole
grid (3,125 starts for two terms) is scored in one pass; L-BFGS then runs only from the best few
starts, then once more from the winner so that a stale curvature memory cannot stop it early. Log x is
centred on its mean (a_k is optimised as the log of term k at the data's geometric centre), which
decorrelates a_k from alpha_k and makes the grid independent of the units of N, D or C.

Exponents are boxed in [0, 2] (L-BFGS-B bounds, analysis.laws.optim.MAX_EXPONENT): over a short span
of data a high floor E trades against a steep term with a huge coefficient, an optimum that is a step,
not a law to extrapolate.

Uncertainty: a nonparametric bootstrap (points resampled with replacement, each refit started from
the full-data optimum, to a looser tolerance than the point fit); parameter intervals are percentiles
of the refits. A prediction's interval
is for a held-out point, not only for the mean law: the spread of the refits' log predictions and the
scatter of the points about the law (robust sd of the log residuals, inflated by n/(n - Q)) added in
quadrature, on log loss, and beyond the data a backtested extrapolation term: refit on the points
with x <= max/4, its error per e-fold beyond them; for L(N, D) measured both in N and in compute
C = 6ND (the larger applies), since a compute-optimal forecast for a larger budget of an IsoFLOP grid
extrapolates in C at an N the data may already hold. analysis.laws.backtest measures the coverage that interval reaches on points
the fit never saw.

Honesty: every fit carries `warnings` (analysis.fitwarn): the floor E at its bound 0, an exponent at
a bound or steeper than 1 (no language-model law is), the floor E above 90% of the smallest loss, no
more points than parameters, fewer than three distinct sizes, bootstrap refits that disagree wildly.
`converged` is False when the optimum sits on a bound or an exponent is steeper than 1.

The optimiser (objective, start grid, L-BFGS, degeneracy test) lives in analysis.laws.optim; the fitted
laws (their predictions, intervals and JSON) in analysis.laws.fitted.

Shape legend: S starts, Q parameters (2K+1), K power terms, R data rows, B bootstrap draws.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np

from analysis import fitwarn
from analysis.laws.fitted import (HUBER_DELTA, EnvelopeFit, FitError, LawFit, MoELawFit, _PowerFit, _quantiles,
                                  compute_optimal)
from analysis.laws.optim import MAX_EXPONENT, degeneracy, fit_terms

try:  # a transitive dependency (scikit-learn via mlflow); without it the fit is only slower
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

__all__ = [
    "HUBER_DELTA",
    "FitError",
    "LawFit",
    "EnvelopeFit",
    "MoELawFit",
    "fit_moe_law",
    "fit_law",
    "fit_envelope",
    "refit_envelope",
    "compute_optimal",
]

# The floor E is on its bound (0) when it is below this share of the smallest loss: the data show no
# floor, and E = 6e-11 is the optimiser running down the bound, not an estimate.
_FLOOR_BOUND_SHARE = 1e-3
_MIN_EXPONENT = 1e-3  # an exponent this close to 0 sits on its bound
# An exponent above this is steeper than 1/x: no language-model scaling law is (their exponents are
# 0.05-0.8); on a short span such an optimum is the floor E trading against a steep term.
STEEP_EXPONENT = 1.0
# The floor above this share of the smallest loss leaves the power terms a remainder of every loss.
FLOOR_DOMINANT_SHARE = 0.9


# ----------------------------------------------------------------------------------------------
# Fitting


def _check_inputs(cols: dict[str, Any], n_params: int) -> list[np.ndarray]:
    arrs = []
    n = None
    for name, v in cols.items():
        a = np.asarray(v, dtype=np.float64).reshape(-1)
        if n is not None and len(a) != n:
            raise FitError(f"{name} has {len(a)} values, expected {n} (one per point)")
        n = len(a)
        if np.any(np.isnan(a)):
            raise FitError(f"{name} contains NaN (row {int(np.flatnonzero(np.isnan(a))[0]) + 1})")
        if not np.all(np.isfinite(a)):
            raise FitError(f"{name} contains an infinite value")
        if np.any(a <= 0):
            i = int(np.flatnonzero(a <= 0)[0])
            raise FitError(f"{name} must be positive (row {i + 1} is {a[i]:g})")
        arrs.append(a)
    if n < n_params:
        raise FitError(f"{n} point(s) cannot determine {n_params} parameters: need at least {n_params}")
    for name, a in list(cols.items())[:-1]:
        if np.ptp(np.log(a)) == 0:
            raise FitError(f"all points share one value of {name}: its exponent cannot be fitted")
    return arrs


def _single_blas_thread():
    """L-BFGS-B makes thousands of tiny BLAS calls; a multi-threaded BLAS spins its threads on each
    one and, on a busy 2-core machine, runs ~100x slower than one thread."""
    if threadpool_limits is None:
        import contextlib

        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _run(*args, **kwargs):
    with _single_blas_thread():
        return _run_fit(*args, **kwargs)


def _centred(params: dict[str, float], names, exps, centre_K: np.ndarray) -> np.ndarray:
    """Natural parameters -> the optimiser's centred coordinates (a_1.., alpha_1.., e)."""
    al = np.array([params[k] for k in exps])
    a = np.log([params[k] for k in names]) - al * centre_K
    return np.concatenate([a, al, [math.log(max(params["E"], 1e-300))]])


def _start_kw(start) -> dict[str, Any]:
    """start: a fit of nearby data (its optimum and its extrapolation sub-fit's warm-start the refit and
    its own sub-fit) or a dict of natural parameters; None: the start grid."""
    if start is None:
        return {}
    if isinstance(start, _PowerFit):
        return {"start": start.params, "sub_start": start.sub_params}
    return {"start": dict(start)}


def _run_fit(
    xs: list[np.ndarray], loss: np.ndarray, terms: Sequence[tuple[str, str, str]], *,
    delta: float, n_bootstrap: int, level: float, seed: int, strict: bool, max_iter: int,
    start: dict[str, float] | None = None, sub_start: dict[str, float] | None = None, compute_axis: bool = False,
):
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_bootstrap < 0 or not delta > 0 or max_iter < 1:
        raise ValueError("n_bootstrap must be >= 0, delta > 0 and max_iter >= 1")
    t0 = time.perf_counter()
    K = len(xs)
    names = tuple(t[0] for t in terms)
    exps = tuple(t[1] for t in terms)
    logx_KR = np.log(np.stack(xs))
    centre_K = logx_KR.mean(axis=1)
    X_KR = logx_KR - centre_K[:, None]
    y_R = np.log(loss)
    n = len(y_R)

    def natural(p_Q: np.ndarray) -> np.ndarray:
        # centred a_k is log of term k at the centre: A_k = exp(a_k + alpha_k * centre_k)
        p_Q = np.asarray(p_Q)
        a, al, e = p_Q[..., :K], p_Q[..., K : 2 * K], p_Q[..., 2 * K]
        return np.concatenate([np.exp(e)[..., None], np.exp(a + al * centre_K), al], axis=-1)

    best = None
    if start is not None:  # a warm start (a fit of nearby data); the grid where it finds no optimum
        best = fit_terms(X_KR, y_R, None, delta, max_iter, starts_SQ=_centred(start, names, exps, centre_K)[None])
        if not best.ok or degeneracy(best.p_Q, X_KR, y_R, terms) is not None:
            best = None
    if best is None:
        best = fit_terms(X_KR, y_R, None, delta, max_iter)
    why = None if best.ok else f"L-BFGS stopped without an optimum ({best.message}, {best.nit} iterations)"
    why = why or degeneracy(best.p_Q, X_KR, y_R, terms)
    usable = why is None
    if not usable and strict:
        raise FitError(f"the fit did not converge to a usable law: {why}")

    theta_Q = natural(best.p_Q)
    keys = ("E", *names, *exps)
    params = {k: float(v) for k, v in zip(keys, theta_Q)}
    warnings = _bound_warnings(params, exps, float(np.exp(y_R.min())))
    # an optimum on a bound, or with an exponent steeper than any language-model law, is not a converged estimate
    converged = usable and not warnings
    warnings += _floor_share_warnings(params, float(np.exp(y_R.min())))
    if why:
        warnings.insert(0, f"no usable law: {why}")
    warnings += fitwarn.too_few_points(n, len(keys))
    n_sizes = len(np.unique(np.round(logx_KR[0], 6)))
    warnings += fitwarn.too_few_sizes(n_sizes, f"distinct values of {terms[0][2]}")
    pred_R = np.log(natural_eval(theta_Q, xs))
    r_R = y_R - pred_R
    dof = max(n - len(keys), 1)
    resid_sd = float(1.4826 * np.median(np.abs(r_R - np.median(r_R))) * math.sqrt(n / dof)) if n > len(keys) else 0.0

    draws, failed = [], 0
    if usable and n_bootstrap > 0:
        rng = np.random.default_rng(seed)
        for _ in range(n_bootstrap):
            w_R = np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64)
            loc = fit_terms(X_KR, y_R, w_R, delta, max_iter, starts_SQ=best.p_Q[None], polish=False, loose=True)
            if loc.ok and degeneracy(loc.p_Q, X_KR, y_R, terms) is None:
                draws.append(loc.p_Q)
            else:
                failed += 1
    draws_BQ = natural(np.array(draws)) if draws else np.empty((0, len(keys)))
    ci = {k: (_quantiles(draws_BQ[:, i], level) if len(draws_BQ) else [math.nan, math.nan]) for i, k in enumerate(keys)}
    warnings += fitwarn.bootstrap_disagreement(ci, len(draws), failed, positive=keys)
    extrap_sd, sub_params = (_extrapolation_sd(xs, loss, terms, delta=delta, max_iter=max_iter, start=sub_start)
                             if usable and n_bootstrap > 0 else (0.0, None))
    if math.isnan(extrap_sd):
        warnings.append(f"the intervals beyond the largest {terms[0][2]} carry no backtested extrapolation term: "
                        f"{n} points leave too few below the largest {terms[0][2]} to refit ({len(keys) + 2} needed); "
                        "predictions there are less certain than their intervals say")
        extrap_sd = 0.0
    extrap_sd_c, c_max = 0.0, math.inf
    if compute_axis and usable and n_bootstrap > 0:
        c_R = 6.0 * xs[0] * xs[1]
        extrap_sd_c, _ = _extrapolation_sd(xs, loss, terms, delta=delta, max_iter=max_iter, start=params, axis=c_R,
                                           less_scatter=True)
        c_max = float(np.max(c_R))
        extrap_sd_c = 0.0 if math.isnan(extrap_sd_c) else extrap_sd_c
    message = why or ("; ".join(warnings[:1]) if not converged else "")
    return dict(
        params=params, ci=ci, draws=draws_BQ, n_points=n, loss=best.loss, converged=converged,
        level=level, n_bootstrap=len(draws), n_bootstrap_failed=failed,
        seconds=time.perf_counter() - t0, message=message, huber_delta=delta,
        warnings=warnings, resid_sd=resid_sd, sizes=n_sizes, x_max=float(np.max(xs[0])), extrap_sd=extrap_sd,
        sub_params=sub_params, **({"extrap_sd_c": extrap_sd_c, "c_max": c_max} if compute_axis else {}),
    )


def refit_envelope(C, loss_BR, start: dict[str, float], *, delta: float = HUBER_DELTA,
                   max_iter: int = 3000) -> np.ndarray:
    """Refits of L(C) = E + A*C^-alpha to B sets of losses at the same compute C, each one L-BFGS
    started from `start` (E, A, alpha: a fit of nearby data): (B, 3) natural parameters (E, A,
    alpha), a row of NaN where a refit found no usable law. A parametric bootstrap's refits."""
    C = np.asarray(C, dtype=np.float64).reshape(-1)
    L_BR = np.atleast_2d(np.asarray(loss_BR, dtype=np.float64))
    logx = np.log(C)
    centre = float(logx.mean())
    X_KR = (logx - centre)[None]
    terms = [("A", "alpha", "C")]
    p0 = np.array([math.log(start["A"]) - start["alpha"] * centre, start["alpha"], math.log(max(start["E"], 1e-300))])
    out = np.full((len(L_BR), 3), np.nan)
    with _single_blas_thread():
        for b, L_R in enumerate(L_BR):
            if not np.all(np.isfinite(L_R) & (L_R > 0)):
                continue
            y_R = np.log(L_R)
            loc = fit_terms(X_KR, y_R, None, delta, max_iter, starts_SQ=p0[None])
            if loc.ok and degeneracy(loc.p_Q, X_KR, y_R, terms) is None:
                a, al, e = loc.p_Q
                out[b] = (math.exp(e), math.exp(a + al * centre), al)
    return out


EXTRAP_FACTOR = 4.0


def _extrapolation_sd(xs, loss, terms, *, delta, max_iter, start=None, axis=None,
                      less_scatter: bool = False) -> tuple[float, dict[str, float] | None]:
    """(log-loss error per e-fold of extrapolation in the first variable, or in `axis` (per point: the
    compute 6ND), the sub-fit's parameters): refit on the points with x <= max/4 (or, where too few lie
    there, on those below the largest x) and predict the rest; sqrt(sum e^2 / sum rho^2), rho =
    log(x / largest fitted x). (nan, None) when too few points lie on either side: the term is then
    unknown, not 0. less_scatter: each e^2 less the sub-fit's residual variance (the points' own
    scatter, which the interval already carries), so that only the error that grows with rho remains."""
    out = _extrap_errors(xs, loss, terms, delta=delta, max_iter=max_iter, start=start, axis=axis)
    if out is None:
        return math.nan, None
    e, rho, sub = out
    e2 = np.sum(e * e) - (len(e) * sub["resid_sd"] ** 2 if less_scatter else 0.0)
    return float(math.sqrt(max(e2, 0.0) / max(np.sum(rho * rho), 1e-12))), sub["params"]


def _extrap_errors(xs, loss, terms, *, delta, max_iter, start=None, axis=None):
    """(log errors, e-folds beyond the largest fitted x, the sub-fit) of _extrapolation_sd, or None."""
    x = xs[0] if axis is None else axis
    n_q = 2 * len(terms) + 1
    train = x <= np.max(x) / EXTRAP_FACTOR * (1 + 1e-9)
    if train.sum() < n_q + 2:
        train = x < np.max(x) * (1 - 1e-9)
    if train.sum() < n_q + 2 or (~train).sum() < 1:
        return None
    sub = _run_fit([a[train] for a in xs], loss[train], terms, delta=delta, n_bootstrap=0, level=0.9, seed=0,
                   strict=False, max_iter=max_iter, start=start)
    if sub["message"] and not sub["params"]:
        return None
    theta = np.array([sub["params"][k] for k in ("E", *(t[0] for t in terms), *(t[1] for t in terms))])
    pred = natural_eval(theta, [a[~train] for a in xs])
    if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
        return None
    e = np.log(loss[~train]) - np.log(pred)
    rho = np.log(x[~train] / np.max(x[train]))
    return e, rho, sub


def natural_eval(theta_Q: np.ndarray, xs: Sequence[np.ndarray]) -> np.ndarray:
    """E + sum_k A_k x_k^-alpha_k for natural parameters (E, A_1.., alpha_1..)."""
    K = len(xs)
    out = np.full(len(xs[0]), theta_Q[0])
    for k in range(K):
        out = out + theta_Q[1 + k] * xs[k] ** -theta_Q[1 + K + k]
    return out


def _floor_share_warnings(params: dict[str, float], loss_min: float) -> list[str]:
    """The floor E taking most of the smallest loss: the power terms that carry the law's extrapolation are
    a small remainder of every loss in the data, and the floor is not separated from them."""
    share = params["E"] / loss_min
    if share > FLOOR_DOMINANT_SHARE:
        return [f"E = {params['E']:.4g} is {100 * share:.0f}% of the smallest loss ({loss_min:.4g}): the power terms "
                f"carry under {100 * (1 - FLOOR_DOMINANT_SHARE):.0f}% of any loss in this data, the floor is not "
                "separated from them, and the law's extrapolation is set by where it put the floor"]
    return []


def _bound_warnings(params: dict[str, float], exps: Sequence[str], loss_min: float) -> list[str]:
    """The floor at its bound 0, exponents at theirs (0 and MAX_EXPONENT) or steeper than STEEP_EXPONENT."""
    out = []
    if params["E"] < _FLOOR_BOUND_SHARE * loss_min:
        out.append(f"E = {params['E']:.3g} is at its lower bound 0: this data shows no loss floor, and the law's "
                   "extrapolation falls without limit")
    for k in exps:
        v = params[k]
        if v < _MIN_EXPONENT:
            out.append(f"{k} = {v:.3g} is at its lower bound 0")
        elif v > MAX_EXPONENT * (1 - fitwarn.NEAR_BOUND_REL):
            out.append(f"{k} = {v:.3g} is at its upper bound {MAX_EXPONENT:g}: a step, not a power law, and the "
                       "optimum may lie beyond it")
        elif v > STEEP_EXPONENT:
            out.append(f"{k} = {v:.3g} is steeper than any language-model scaling law (their exponents are "
                       f"0.05-0.8): over this data's span a steep term with a huge coefficient trades against the floor E "
                       "and the other term, and the law's extrapolation is not to be trusted")
    return out


def fit_law(
    N, D, loss, *, delta: float = HUBER_DELTA, n_bootstrap: int = 200, level: float = 0.95,
    seed: int = 0, strict: bool = True, max_iter: int = 3000, start=None,
) -> LawFit:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to points (N params, D tokens, final loss).

    Raises FitError on too few points (< 5), non-positive/NaN values, no spread in N or D, or a fit
    that does not converge (with strict=False it returns converged=False and no intervals instead).
    """
    Nv, Dv, Lv = _check_inputs({"N": N, "D": D, "loss": loss}, 5)
    return LawFit(**_run([Nv, Dv], Lv, [("A", "alpha", "N"), ("B", "beta", "D")], delta=delta,
                         n_bootstrap=n_bootstrap, level=level, seed=seed, strict=strict, max_iter=max_iter,
                         compute_axis=True, **_start_kw(start)))


def fit_envelope(
    C, loss, *, delta: float = HUBER_DELTA, n_bootstrap: int = 200, level: float = 0.95,
    seed: int = 0, strict: bool = True, max_iter: int = 3000, start=None,
) -> EnvelopeFit:
    """Fit the compute envelope L(C) = E + A*C^-alpha to (compute, best loss at that compute) points."""
    Cv, Lv = _check_inputs({"C": C, "loss": loss}, 3)
    return EnvelopeFit(**_run([Cv], Lv, [("A", "alpha", "C")], delta=delta,
                              n_bootstrap=n_bootstrap, level=level, seed=seed, strict=strict, max_iter=max_iter,
                         **_start_kw(start)))


def fit_moe_law(
    N_active, N_total, D, loss, *, delta: float = HUBER_DELTA, n_bootstrap: int = 200, level: float = 0.95,
    seed: int = 0, strict: bool = True, max_iter: int = 3000, start=None,
) -> MoELawFit:
    """Fit L = E + A/N_active^alpha + G/N_total^gamma + B/D^beta to runs of different sparsity.

    The data must vary the sparsity (N_total / N_active) independently of size: on a ladder that
    keeps one sparsity, log N_total is log N_active plus a constant and the two terms cannot be told
    apart (FitError; use fit_law with either count).
    """
    Na, Nt, Dv, Lv = _check_inputs({"N_active": N_active, "N_total": N_total, "D": D, "loss": loss}, 7)
    if np.any(Nt < Na):
        i = int(np.flatnonzero(Nt < Na)[0])
        raise FitError(f"N_total must be >= N_active (row {i + 1}: {Nt[i]:g} < {Na[i]:g})")
    la, lt = np.log(Na), np.log(Nt)
    resid = (lt - la) - np.mean(lt - la)
    if np.ptp(resid) < 1e-6 or abs(np.corrcoef(la, lt)[0, 1]) > 0.999:
        raise FitError(
            "N_total moves in lockstep with N_active in this data (one sparsity): the total-parameter "
            "term cannot be separated; fit L(N, D) with either count instead"
        )
    return MoELawFit(**_run([Na, Nt, Dv], Lv, [("A", "alpha", "N_active"), ("G", "gamma", "N_total"), ("B", "beta", "D")],
                            delta=delta, n_bootstrap=n_bootstrap, level=level, seed=seed, strict=strict,
                            max_iter=max_iter, **_start_kw(start)))
