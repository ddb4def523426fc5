"""The curve models' optimiser: a Huber loss on log(loss) - log(pred) summed over every point of
every curve, its gradient, the search bounds, starts (the 'instant' linearised model and a few
shapes of the LR response) and L-BFGS-B (analysis.curves.fit describes the two-stage fit).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import minimize

from analysis.curves.design import LOG_BOUNDS, LRA_MOMENTUM, MODEL_PARAMS
from analysis.curves.sizelaw import CHINCHILLA_ALPHA, SizeLaw

HUBER_DELTA = 1e-2  # on log loss; analysis.curves.fit says why not the published 1e-3


def huber(r: np.ndarray, delta: float):
    a = np.abs(r)
    quad = a < delta
    return np.where(quad, 0.5 * r * r, delta * (a - 0.5 * delta)), np.where(quad, r, delta * np.sign(r))


def objective(z, designs, ys, log_ns, law: SizeLaw, weights):
    f = 0.0
    g = np.zeros(len(z))
    for des, y, log_n, w in zip(designs, ys, log_ns, weights):
        th, Jz = law.theta(z, log_n)
        pred, J = des.predict(th, grad=True)
        ok = pred > 1e-9
        r = np.log(y) - np.log(np.where(ok, pred, 1e-9))
        h, dh = huber(r, HUBER_DELTA)
        wh = h if w is None else w * h
        f += float(wh.sum())
        dpred = np.where(ok, -(dh if w is None else w * dh) / np.where(ok, pred, 1.0), 0.0)
        g += (dpred @ J) @ Jz
    if not math.isfinite(f):
        return 1e30, np.zeros(len(z))
    return f, g


def bounds_for(law: SizeLaw, y_min: float) -> list[tuple[float | None, float | None]]:
    out = []
    for name in law.names:
        if name in ("L0", "E"):
            out.append((0.0, y_min))
        elif name == "a":
            out.append((-12.0, 3.0))
        elif name == "p":
            out.append((math.log(0.05), math.log(1.5)))
        elif name.startswith("s_"):
            out.append((-1.5, 1.5))
        else:
            out.append(LOG_BOUNDS[name])
    return out


def lbfgs(z0, args, bounds, maxiter=4000):
    return minimize(
        objective, z0, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
        options={"maxiter": maxiter, "maxfun": 3 * maxiter, "ftol": 1e-13, "gtol": 1e-9},
    )


def linearised_start(designs, ys, weights=None) -> np.ndarray:
    """(L0, log A, log alpha, b) of the 'instant' model L0 + A S1^-alpha + b eta_t / eta_max, the
    Multi-Power Law with every LR change fully felt at once (G = 1), from a small grid of starts
    (the published fit starts from the same linearised model). b / eta_max estimates B."""
    y_min = min(float(y.min()) for y in ys)
    logS1 = np.concatenate([d.logS1_n for d in designs])
    eta = np.concatenate([d.eta_n for d in designs])
    y = np.concatenate(ys)
    w = None if weights is None else np.concatenate(weights)
    eta_ref = float(eta.max())

    def obj(v):
        L0, lA, lal, b = v
        al = math.exp(lal)
        pw = np.exp(lA - al * logS1)
        pred = L0 + pw + b * eta / eta_ref
        ok = pred > 1e-9
        r = np.log(y) - np.log(np.where(ok, pred, 1e-9))
        h, dh = huber(r, HUBER_DELTA)
        if w is not None:
            h, dh = w * h, w * dh
        dp = np.where(ok, -dh / np.where(ok, pred, 1.0), 0.0)
        return float(h.sum()), np.array([dp.sum(), (dp * pw).sum(), -(dp * pw * logS1).sum() * al, (dp * eta).sum() / eta_ref])

    best = None
    bnds = [(0.0, y_min), (-12.0, 8.0), LOG_BOUNDS["alpha"], (0.0, y_min)]
    for frac in (0.5, 0.8, 0.95):
        for al in (0.3, 0.6):
            L0 = frac * y_min
            lA = math.log(max(float(np.median(y)) - L0, 1e-3)) + al * float(np.median(logS1))
            r = minimize(obj, [L0, lA, math.log(al), 0.01 * y_min], jac=True, method="L-BFGS-B", bounds=bnds,
                         options={"maxiter": 2000})
            if best is None or r.fun < best.fun:
                best = r
    return best.x


def start_points(model: str, lin: np.ndarray, eta_ref: float) -> list[np.ndarray]:
    L0, lA, lal, b = lin
    if model == "lra":
        # C * S2 ~ b eta / eta_ref after a long decay, and S2 ~ drop / (1 - lambda)
        lC = math.log(max(b, 1e-4) / eta_ref * (1.0 - LRA_MOMENTUM))
        return [np.array([L0, lA, lal, lC + k]) for k in (0.0, -1.5, 1.5)]
    lB = math.log(max(b, 1e-6) / eta_ref)
    out = []
    # x = C eta^-gamma S: start with C eta_ref^(1-gamma) ~ 1/(few hundred steps) .. 1/(few steps)
    for c_steps, be, ga in ((30.0, 0.5, 0.5), (300.0, 1.0, 0.8), (3.0, 0.4, 0.3), (100.0, 1.5, 0.6)):
        lC = -math.log(c_steps) - (1.0 - ga) * math.log(eta_ref)
        out.append(np.array([L0, lA, lal, lB, lC, math.log(be), math.log(ga)]))
    return out


def clip_to(z: np.ndarray, bounds) -> np.ndarray:
    lo = np.array([-np.inf if b[0] is None else b[0] for b in bounds])
    hi = np.array([np.inf if b[1] is None else b[1] for b in bounds])
    return np.clip(z, lo, hi)


def fix_bound(bounds, i: int, v: float):
    out = list(bounds)
    out[i] = (v, v)
    return out


def fit_one_size(model, designs, ys, weights, eta_ref, y_min, lin=None, joint=False):
    """Fit of curves of one size: for the Multi-Power Law in two stages, B from the instant model
    (stage 1), then L0, A, alpha, C, beta, gamma with B held (stage 2). B and the slow tail of G
    trade off (a larger B with a slower-saturating G fits a few thousand steps after a drop as well
    as a smaller B with a quick one); anchoring B to the settled response estimated by the instant
    model is what extrapolates to longer horizons. Returns the best scipy result and the bounds."""
    law = SizeLaw(model, "none")
    bounds = bounds_for(law, y_min)
    if lin is None:
        lin = linearised_start(designs, ys, weights)
    starts = start_points(model, lin, eta_ref)
    if model == "mpl" and not joint:
        lB = float(np.clip(starts[0][3], *LOG_BOUNDS["B"]))
        bounds = fix_bound(bounds, 3, lB)
    args = (designs, ys, [None] * len(ys), law, weights or [None] * len(ys))
    results = [lbfgs(clip_to(z0, bounds), args, bounds) for z0 in starts]
    best = min(results, key=lambda r: r.fun if np.isfinite(r.fun) else np.inf)
    return best, results, bounds


def sized_start(thetas: list[np.ndarray], log_ns: list[float], law: SizeLaw) -> np.ndarray:
    """Start of a size-law fit from per-size fits: L0 = E + a (N/N_ref)^-p solved for E, a at the
    start's p; slopes of log A, log alpha, log B in log N by least squares; C, beta, gamma averaged."""
    th = np.asarray(thetas)
    x = np.asarray(log_ns) - law.log_nref
    p = CHINCHILLA_ALPHA
    M = np.stack([np.ones_like(x), np.exp(-p * x)], 1)
    (E, a), *_ = np.linalg.lstsq(M, th[:, 0], rcond=None)
    if not (a > 0 and E > 0):
        # short, noisy per-size fits can give L0 <= 0; start from a positive split instead
        m = max(float(np.median(th[:, 0])), 1e-2)
        E, a = 0.7 * m, 0.3 * m
    head = [E, math.log(a)] + ([math.log(p)] if law.kind == "many" else [])
    names = MODEL_PARAMS[law.model]
    base = th[:, 1:].mean(0)
    slopes = []
    for k in [k for k in law.scaled if k in names]:
        i = names.index(k)
        s_, c_ = np.polyfit(x, th[:, i], 1)
        base[i - 1] = c_
        slopes.append(s_)
    return np.r_[head, base, slopes]
