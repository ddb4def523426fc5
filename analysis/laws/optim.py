"""The scaling-law optimiser (analysis.laws.fit describes the method): the summed Huber objective on
log loss and its analytic gradient, vectorised over starts; the start grid; L-BFGS from the best
starts and a polish; and the test that an optimum is a usable power law.

Shape legend: S starts, Q parameters (2K+1), K power terms, R data rows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import minimize

__all__ = ["Local", "MAX_EXPONENT", "degeneracy", "fit_terms", "objective_one"]

# Start grid, per term: the term's share of the median loss at the data's centre, and its exponent;
# and the floor E as a fraction of the smallest loss. Relative to the data, so no unit assumptions.
GRID_TERM_SHARE = (0.02, 0.08, 0.25, 0.5, 1.0)
GRID_EXPONENT = (0.1, 0.3, 0.6, 1.0, 1.5)
GRID_FLOOR_SHARE = (0.05, 0.3, 0.6, 0.8, 0.95)
# With three terms, 5 values per axis would be 5^7 starts; 3 per axis keeps the grid near 2,000.
GRID_COARSE = ((0.05, 0.3, 1.0), (0.2, 0.5, 1.0), (0.05, 0.5, 0.9))
N_LOCAL = 8  # L-BFGS runs from this many best grid starts

# Exponents are searched in [0, MAX_EXPONENT] (L-BFGS-B box): the exponents of language-model scaling
# laws are 0.05-0.8, and a steeper "power law" over a short span is a step that a high floor E trades
# against (E absorbing the loss, a huge coefficient), not a law to extrapolate. An optimum on the bound
# is reported as such (analysis.laws.fit: a warning, converged False). A fitted exponent <= 0 or a term
# below MIN_TERM_SHARE of the loss everywhere in the data means the optimiser ran off to a degenerate
# limit instead of a finite optimum.
MAX_EXPONENT = 2.0
MIN_TERM_SHARE = 1e-6
# L-BFGS tolerances: a point fit runs to machine precision; a bootstrap refit, started next to its
# optimum, stops once its objective moves by less than 1e-9 relative (parameter changes far
# below the bootstrap's own spread).
TIGHT = dict(ftol=1e-15, gtol=1e-11)
LOOSE = dict(ftol=1e-9, gtol=1e-8)


# Objective: vectorised over starts (S) and, for the bootstrap, weighted per row.


def objective(P_SQ: np.ndarray, X_KR: np.ndarray, y_R: np.ndarray, w_R: np.ndarray | None, delta: float):
    """Sum of Huber(log L_hat - log L) and its gradient, for every start at once."""
    K = X_KR.shape[0]
    a_SK, alpha_SK, e_S = P_SQ[:, :K], P_SQ[:, K : 2 * K], P_SQ[:, 2 * K]
    u_STR = np.empty((P_SQ.shape[0], K + 1, X_KR.shape[1]))
    u_STR[:, :K] = a_SK[:, :, None] - alpha_SK[:, :, None] * X_KR[None]
    u_STR[:, K] = e_S[:, None]
    m_S1R = u_STR.max(axis=1, keepdims=True)
    ex_STR = np.exp(u_STR - m_S1R)
    z_S1R = ex_STR.sum(axis=1, keepdims=True)
    r_SR = (m_S1R + np.log(z_S1R))[:, 0] - y_R
    # Huber via the clipped residual c: c*(r - c/2) is r^2/2 inside [-delta, delta], delta*(|r| - delta/2) outside
    dh_SR = np.clip(r_SR, -delta, delta)
    h_SR = dh_SR * (r_SR - 0.5 * dh_SR)
    if w_R is not None:
        h_SR = h_SR * w_R
        dh_SR = dh_SR * w_R
    # d LSE / d u_t is the softmax share of term t
    gu_STR = (dh_SR / z_S1R[:, 0])[:, None, :] * ex_STR
    g_SQ = np.empty_like(P_SQ)
    g_SQ[:, :K] = gu_STR[:, :K].sum(-1)
    g_SQ[:, K : 2 * K] = -(gu_STR[:, :K] * X_KR[None]).sum(-1)
    g_SQ[:, 2 * K] = gu_STR[:, K].sum(-1)
    return h_SR.sum(-1), g_SQ


@dataclass
class Local:
    p_Q: np.ndarray
    loss: float
    grad_max: float
    nit: int
    message: str
    ok: bool


def objective_one(p_Q: np.ndarray, X_KR: np.ndarray, y_R: np.ndarray, w_R: np.ndarray | None, delta: float):
    """objective for a single start, without the start axis: L-BFGS calls it thousands of times."""
    K = X_KR.shape[0]
    u_TR = np.empty((K + 1, X_KR.shape[1]))
    np.multiply(p_Q[K : 2 * K, None], X_KR, out=u_TR[:K])
    np.subtract(p_Q[:K, None], u_TR[:K], out=u_TR[:K])
    u_TR[K] = p_Q[2 * K]
    m_R = u_TR.max(axis=0)
    ex_TR = np.exp(u_TR - m_R)
    z_R = ex_TR.sum(axis=0)
    r_R = m_R + np.log(z_R) - y_R
    dh_R = np.clip(r_R, -delta, delta)
    h_R = dh_R * (r_R - 0.5 * dh_R)
    if w_R is not None:
        h_R = h_R * w_R
        dh_R = dh_R * w_R
    gu_TR = ex_TR * (dh_R / z_R)
    g_Q = np.empty_like(p_Q)
    g_Q[:K] = gu_TR[:K].sum(-1)
    g_Q[K : 2 * K] = -(gu_TR[:K] * X_KR).sum(-1)
    g_Q[2 * K] = gu_TR[K].sum()
    return float(h_R.sum()), g_Q


def exponent_bounds(K: int) -> list[tuple[float | None, float | None]]:
    """L-BFGS-B bounds in centred coordinates (a_1.., alpha_1.., e): only the exponents are boxed."""
    return [(None, None)] * K + [(0.0, MAX_EXPONENT)] * K + [(None, None)]


def lbfgs(p0_Q, X_KR, y_R, w_R, delta, maxiter, loose: bool = False) -> Local:
    def fg(p_Q):
        return objective_one(p_Q, X_KR, y_R, w_R, delta)

    K = X_KR.shape[0]
    p0_Q = np.array(p0_Q, dtype=np.float64)
    p0_Q[K : 2 * K] = np.clip(p0_Q[K : 2 * K], 0.0, MAX_EXPONENT)
    with np.errstate(over="ignore", invalid="ignore"):
        res = minimize(
            fg, p0_Q, jac=True, method="L-BFGS-B", bounds=exponent_bounds(K),
            options=dict(maxiter=maxiter, maxcor=20, maxls=50, **(LOOSE if loose else TIGHT)),
        )
    _, g_Q = fg(res.x)
    grad_max = float(np.max(np.abs(g_Q)))
    finite = bool(np.all(np.isfinite(res.x)) and np.isfinite(res.fun))
    # status 2 (the line search found no decrease) at a vanishing gradient is an optimum reached at
    # machine precision; elsewhere it is a stall. Status 1 is the iteration limit.
    # (the exponents' gradient does not vanish where they sit on their bound)
    g_free = np.where(_on_bound(res.x, K), 0.0, g_Q)
    tiny_grad = float(np.max(np.abs(g_free))) <= 1e-5 * delta * len(y_R)
    ok = finite and (res.status == 0 or (res.status == 2 and tiny_grad))
    return Local(res.x, float(res.fun), grad_max, int(res.nit), str(res.message), ok)


def _on_bound(p_Q: np.ndarray, K: int) -> np.ndarray:
    out = np.zeros(len(p_Q), dtype=bool)
    al = p_Q[K : 2 * K]
    out[K : 2 * K] = (al <= 0.0) | (al >= MAX_EXPONENT)
    return out


def start_grid(K: int, y_R: np.ndarray) -> np.ndarray:
    shares, exponents, floors = (GRID_TERM_SHARE, GRID_EXPONENT, GRID_FLOOR_SHARE) if K <= 2 else GRID_COARSE
    l_med, l_min = float(np.exp(np.median(y_R))), float(np.exp(np.min(y_R)))
    a_vals = np.log(l_med * np.array(shares))
    e_vals = np.log(l_min * np.array(floors))
    axes = [a_vals] * K + [np.array(exponents)] * K + [e_vals]
    return np.array(list(itertools.product(*axes)), dtype=np.float64)


def degeneracy(p_Q: np.ndarray, X_KR: np.ndarray, y_R: np.ndarray, terms: Sequence[tuple[str, str, str]]) -> str | None:
    """Why an optimum is not a usable power law, or None. terms: (coefficient, exponent, variable)."""
    K = X_KR.shape[0]
    for k, (coef, exp, var) in enumerate(terms):
        alpha = p_Q[K + k]
        if alpha <= 0.0:
            return f"{exp} = {alpha:.3g} is not positive: the loss does not fall with {var} in this data"
        term_max = np.max(p_Q[k] - alpha * X_KR[k])
        if term_max - np.max(y_R) < math.log(MIN_TERM_SHARE):
            return f"{coef} -> 0: the {coef}/{var}^{exp} term vanished, the loss does not fall with {var} in this data"
    return None


def fit_terms(
    X_KR: np.ndarray, y_R: np.ndarray, w_R: np.ndarray | None, delta: float, maxiter: int,
    starts_SQ: np.ndarray | None = None, polish: bool = True, loose: bool = False,
) -> Local:
    """Best optimum over the start grid (or over `starts_SQ`), in centred coordinates; polish: restart
    L-BFGS from the winner (a bootstrap refit warm-started next to its optimum needs no second run);
    loose: the bootstrap's looser tolerances (LOOSE)."""
    if starts_SQ is None:
        grid_SQ = start_grid(X_KR.shape[0], y_R)
        f_S, _ = objective(grid_SQ, X_KR, y_R, w_R, delta)
        order = np.argsort(np.where(np.isfinite(f_S), f_S, np.inf))
        starts_SQ = grid_SQ[order[:N_LOCAL]]
    best: Local | None = None
    for p0_Q in starts_SQ:
        loc = lbfgs(p0_Q, X_KR, y_R, w_R, delta, maxiter, loose=loose)
        if loc.ok and (best is None or loc.loss < best.loss):
            best = loc
    if best is None:
        return loc  # every start failed; report the last one
    if not polish:
        return best
    # Restart from the winner with a fresh curvature memory: a stale one can stop a long run early.
    polish = lbfgs(best.p_Q, X_KR, y_R, w_R, delta, maxiter)
    if polish.ok and polish.loss <= best.loss:
        polish.nit += best.nit
        return polish
    return best
