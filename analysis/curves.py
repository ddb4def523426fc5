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
per-curve parameters scale with N: L0(N) = E + a (N/N_ref)^-p (p fixed at CHINCHILLA_ALPHA with two
sizes, fitted with three or more), log A, log alpha and log B linear in log N, C, beta, gamma shared.
With ONE size there is nothing to learn the scaling from, so predicting another size uses a prior
(stated here, reported by `CurveFit.to_dict`, chosen by `size_prior`):
- "kaplan" (default): the whole curve scales as (N / N_fit)^-0.076, Kaplan et al. (2020)'s
  L(N) = (N_c / N)^0.076, a relative change that needs no loss floor;
- "chinchilla": Chinchilla's L(N) = E + A_N/N^0.34 (Hoffmann et al. 2022: E 1.69, A_N 406.4, alpha 0.34),
  rescaled to pass through the fitted L0 at the fitted size, gives L0(N); A, alpha, B, C, beta, gamma
  are kept (in Chinchilla's additive form the data term does not depend on N).
The two published laws disagree by about 0.03 in relative loss per e-fold of N near 1e8 parameters
(Kaplan's slope 0.076, Epoch's refit of Chinchilla ~0.11 there); a band at another size adds that
(SIZE_PRIOR_SD per e-fold, as a relative sd) in quadrature. On the multipower curves (25M <-> 100M)
the Kaplan prior errs by about 1% and the Chinchilla prior by about 5.6%: that data informed the
default, so those curves are no independent test of it.

Bands (`CurveFit.band`): the training residuals' relative scatter, the bootstrap refits' spread, an
extrapolation term in LR area and, at another size, the size term, added in quadrature; the
non-bootstrap parts are scaled by a calibration factor measured leave-one-curve-out on the training
curves (refit without each curve, predict it: the factor makes `level` of the held-out points fall
inside). With a single curve there is nothing to leave out, the factor is 1 and a warning says so.

Warnings (`CurveFit.warnings`): parameters on a bound of their search range (`converged` is then
False), a fit of fewer than three sizes that predicts another size, an uncalibrated band, bootstrap
refits that disagree wildly.

Learning rates: `lr` is either one value per logged step (sampled schedule: linear between samples,
before the first sample a linear warmup from 0 at step 0) or a dense per-step array (lr[s] is the
LR of step s, len > last step), e.g. core.schedule.lr_at(spec, np.arange(spec.total_steps)).

Shape legend: n evaluated steps, T steps of a dense schedule, b lumped LR-change blocks per step,
P model parameters (7 mpl / 4 lra), Z fitted coordinates (P plus the size-law terms), K bootstrap draws.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.optimize import minimize
from scipy.signal import lfilter
from scipy.stats import norm

from analysis import fitwarn

try:  # a transitive dependency (scikit-learn via mlflow); without it the fit is only slower
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover
    threadpool_limits = None

__all__ = [
    "Curve",
    "CurveError",
    "CurveFit",
    "CurveFitError",
    "MODELS",
    "fit_curves",
    "lr_per_step_from_samples",
    "relative_errors",
]

MODELS = ("mpl", "lra")
HUBER_DELTA = 1e-2  # on log loss; see the module docstring
DENSE_STEPS = 32  # LR changes this close to an evaluated step enter LD one by one
BLOCK_RATIO = 1.0 / 8  # farther ones in blocks of width ~ distance * BLOCK_RATIO
LRA_MOMENTUM = 0.999  # Tissue et al.'s lambda
GAMMA_MAX = 1.0

# One-size priors for predicting another model size (see the module docstring).
CHINCHILLA_E, CHINCHILLA_A, CHINCHILLA_ALPHA = 1.69, 406.4, 0.34
KAPLAN_ALPHA_N = 0.076
SIZE_PRIORS = ("kaplan", "chinchilla")
SIZE_PRIOR_SD = 0.03  # relative loss sd per e-fold of N away from the fitted sizes
CALIB_MIN, CALIB_MAX = 0.5, 10.0

_EVAL_CHUNK = 1 << 21  # (evaluated steps x blocks) per chunk when predicting long dense curves


class CurveError(ValueError):
    """Curves or schedules that cannot be used as given; the message names the problem."""


class CurveFitError(CurveError):
    """A fit that did not converge or cannot describe the curves; it says so instead of numbers."""


# ---- learning rates --------------------------------------------------------------------------------


def lr_per_step_from_samples(step, lr, total_steps: int | None = None) -> np.ndarray:
    """Dense per-step LR from samples at logged steps: linear between samples, before the first
    sample a linear warmup from 0 at step 0, after the last one flat. Length total_steps (default
    last step + 1)."""
    step_n = np.asarray(step, dtype=np.float64)
    lr_n = np.asarray(lr, dtype=np.float64)
    if step_n.ndim != 1 or lr_n.shape != step_n.shape or len(step_n) == 0:
        raise CurveError(f"lr samples: need one LR per step, got {lr_n.shape} LRs for {step_n.shape} steps")
    T = int(step_n[-1]) + 1 if total_steps is None else int(total_steps)
    if step_n[0] > 0:
        step_n, lr_n = np.r_[0.0, step_n], np.r_[0.0, lr_n]
    return np.interp(np.arange(T, dtype=np.float64), step_n, lr_n)


def _dense_lr(steps_n: np.ndarray, lr, what: str) -> np.ndarray:
    """Either a dense per-step array (len > last step) or one sample per step (densified)."""
    lr = np.asarray(lr, dtype=np.float64)
    if lr.ndim != 1:
        raise CurveError(f"{what}: lr must be one-dimensional, got shape {lr.shape}")
    if not np.all(np.isfinite(lr)):
        raise CurveError(f"{what}: lr has NaN or infinite values")
    if np.any(lr < 0):
        raise CurveError(f"{what}: lr has negative values")
    last = int(steps_n[-1])
    if len(lr) > last:
        return lr
    if len(lr) == len(steps_n):
        return lr_per_step_from_samples(steps_n, lr)
    raise CurveError(
        f"{what}: lr has {len(lr)} values: give one per logged step ({len(steps_n)}) "
        f"or a per-step schedule covering step {last} (at least {last + 1} values)"
    )


def _check_steps(step, what: str) -> np.ndarray:
    s = np.asarray(step)
    if s.ndim != 1 or len(s) == 0:
        raise CurveError(f"{what}: need a non-empty 1-D array of steps")
    sf = np.asarray(s, dtype=np.float64)
    if not np.all(np.isfinite(sf)):
        raise CurveError(f"{what}: steps have NaN or infinite values")
    if np.any(sf < 0) or np.any(sf != np.round(sf)):
        raise CurveError(f"{what}: steps must be non-negative integers")
    if np.any(np.diff(sf) <= 0):
        i = int(np.flatnonzero(np.diff(sf) <= 0)[0]) + 1
        raise CurveError(f"{what}: steps must be strictly increasing; step {sf[i]:g} follows {sf[i - 1]:g}")
    return sf.astype(np.int64)


@dataclass
class Curve:
    """One loss curve: logged `step`s, the schedule (`lr`: one value per logged step, or a dense
    per-step array), `loss` at those steps (None for a curve only to be predicted) and optionally
    the model's parameter count `params`."""

    step: Any
    lr: Any
    loss: Any = None
    params: float | None = None
    name: str = ""

    def __post_init__(self):
        what = f"curve {self.name!r}" if self.name else "curve"
        self.step = _check_steps(self.step, what)
        self.lr_per_step = _dense_lr(self.step, self.lr, what)
        self.lr = np.asarray(self.lr, dtype=np.float64)
        if self.loss is not None:
            y = np.asarray(self.loss, dtype=np.float64)
            if y.shape != self.step.shape:
                raise CurveError(f"{what}: {len(y)} losses for {len(self.step)} steps")
            if not np.all(np.isfinite(y)):
                raise CurveError(f"{what}: loss has NaN or infinite values")
            if np.any(y <= 0):
                raise CurveError(f"{what}: loss must be positive (the fit is on log loss)")
            self.loss = y
        if self.params is not None:
            p = float(self.params)
            if not math.isfinite(p) or p <= 0:
                raise CurveError(f"{what}: params must be a positive parameter count, got {self.params!r}")
            self.params = p
        if self.lr_per_step[self.step].max() <= 0:
            raise CurveError(f"{what}: the learning rate is zero at every logged step")

    @classmethod
    def from_schedule(cls, step, lr_per_step, loss=None, params=None, name: str = "") -> "Curve":
        """A curve whose schedule is a dense per-step LR array (lr_per_step[s] for step s)."""
        step = _check_steps(step, f"curve {name!r}")
        lr_per_step = np.asarray(lr_per_step, dtype=np.float64)
        if len(lr_per_step) <= step[-1]:
            raise CurveError(f"curve {name!r}: lr_per_step has {len(lr_per_step)} values, steps reach {step[-1]}")
        return cls(step=step, lr=lr_per_step, loss=loss, params=params, name=name)


# ---- per-curve design: everything that does not depend on the model's parameters --------------------


def _block_distances(T: int) -> np.ndarray:
    d = list(range(DENSE_STEPS + 1))
    x = float(DENSE_STEPS)
    while d[-1] < T:
        x = max(x * (1.0 + BLOCK_RATIO), d[-1] + 1.0)
        d.append(int(math.ceil(x)))
    return np.asarray(d, dtype=np.int64)


def _lumped_changes(steps_n: np.ndarray, eta_T: np.ndarray, exact: bool = False):
    """LR changes d_k = eta_{k-1} - eta_k (k >= 1) seen from each evaluated step t, lumped into
    blocks: returns D_nb (summed change), le_nb (mean log eta_k), lS_nb (log S_k(t)), zero D where a
    block is empty. exact=True gives one block per change (the O(T x n) reference)."""
    P_T = np.cumsum(eta_T)
    d_T = np.zeros_like(eta_T)
    d_T[1:] = eta_T[:-1] - eta_T[1:]
    ev = np.flatnonzero(d_T)
    n = len(steps_n)
    if len(ev) == 0:
        z = np.zeros((n, 0))
        return z, z, z
    dE, aE, lE, PE = d_T[ev], np.abs(d_T[ev]), np.log(eta_T[ev]), P_T[ev - 1]
    if exact:
        dist = np.arange(int(steps_n[-1]) + 2)
    else:
        dist = _block_distances(int(steps_n[-1]) + 1)
    t_n1 = steps_n[:, None]
    # block j of step t holds the changes at k in (t - dist[j+1], t - dist[j]]
    hi_nb = np.searchsorted(ev, t_n1 - dist[None, :-1], side="right")
    lo_nb = np.searchsorted(ev, t_n1 - dist[None, 1:], side="right")
    keep_nb = hi_nb > lo_nb
    cols = keep_nb.any(0)
    hi_nb, lo_nb, keep_nb = hi_nb[:, cols], lo_nb[:, cols], keep_nb[:, cols]

    single_nb = (hi_nb - lo_nb) == 1
    first_nb = np.minimum(lo_nb, len(ev) - 1)

    def block_sum(v_e: np.ndarray) -> np.ndarray:
        # O(1) per block from cumulative sums; a block of one change takes its value directly, so
        # the near blocks (and tiny changes after large sums) keep full precision
        c_e = np.concatenate([[0.0], np.cumsum(v_e)])
        out = np.where(single_nb, v_e[first_nb], c_e[hi_nb] - c_e[lo_nb])
        return np.where(keep_nb, out, 0.0)

    A_nb = np.where(keep_nb, block_sum(aE), 1.0)
    D_nb = block_sum(dE)
    le_nb = block_sum(aE * lE) / A_nb
    Pk_nb = block_sum(aE * PE) / A_nb
    S_nb = np.where(keep_nb, P_T[steps_n][:, None] - Pk_nb, 1.0)
    S_nb = np.maximum(S_nb, eta_T[eta_T > 0].min() * 1e-6)
    return D_nb, np.where(keep_nb, le_nb, 0.0), np.log(S_nb)


class _Design:
    """Schedule features of one curve at its evaluated steps, for one model."""

    def __init__(self, model: str, steps_n: np.ndarray, lr_T: np.ndarray, exact: bool = False):
        if len(lr_T) <= steps_n[-1]:
            raise CurveError(f"the schedule has {len(lr_T)} steps, the curve reaches step {steps_n[-1]}")
        eta_T = np.asarray(lr_T[: int(steps_n[-1]) + 1], dtype=np.float64)
        peak = float(eta_T.max())
        if peak <= 0:
            raise CurveError("the learning rate is zero everywhere")
        eta_T = np.maximum(eta_T, peak * 1e-12)  # LR 0 (warmup start, decay to 0) -> G = 1 there
        S1_n = np.cumsum(eta_T)[steps_n]
        self.model = model
        self.n = len(steps_n)
        self.logS1_n = np.log(np.maximum(S1_n, peak * 1e-12))
        self.eta_n = eta_T[steps_n]
        if model == "mpl":
            self.D_nb, self.le_nb, self.lS_nb = _lumped_changes(steps_n, eta_T, exact)
        else:
            d_T = np.zeros_like(eta_T)
            d_T[1:] = eta_T[:-1] - eta_T[1:]
            inc = np.flatnonzero(d_T[1:] > 0)  # warmup = the initial non-decreasing run
            d_T[: inc[0] + 1 if len(inc) else len(d_T)] = 0.0
            m_T = lfilter([1.0], [1.0, -LRA_MOMENTUM], d_T)
            self.S2_n = np.cumsum(m_T)[steps_n]

    def predict(self, th: np.ndarray, grad: bool = False):
        """pred_n (and dpred/dtheta, n x P) for natural-coordinate theta (see _MODEL_PARAMS)."""
        if self.model == "mpl":
            L0, lA, lal, lB, lC, lbe, lga = th
            A, al, B, be, ga = np.exp([lA, lal, lB, lbe, lga])
            pw_n = np.exp(lA - al * self.logS1_n)
            if self.D_nb.shape[1] == 0:
                LD_n = np.zeros(self.n)
                dC_n = dbe_n = dga_n = LD_n
            else:
                a_nb = lC - ga * self.le_nb + self.lS_nb
                logu_nb = np.logaddexp(0.0, a_nb)
                omG_nb = np.exp(-be * logu_nb)
                LD_n = (self.D_nb * (1.0 - omG_nb)).sum(1)
                if grad:
                    w_nb = be * omG_nb * np.exp(a_nb - logu_nb) * self.D_nb  # dG/dlogC, weighted
                    dC_n = w_nb.sum(1)
                    dga_n = -(w_nb * self.le_nb).sum(1) * ga
                    dbe_n = (self.D_nb * omG_nb * logu_nb).sum(1) * be
            pred = L0 + pw_n - B * LD_n
            if not grad:
                return pred
            J = np.stack(
                [np.ones(self.n), pw_n, -pw_n * self.logS1_n * al, -B * LD_n, -B * dC_n, -B * dbe_n, -B * dga_n], 1
            )
            return pred, J
        L0, lA, lal, lC = th
        al, C = math.exp(lal), math.exp(lC)
        pw_n = np.exp(lA - al * self.logS1_n)
        pred = L0 + pw_n - C * self.S2_n
        if not grad:
            return pred
        J = np.stack([np.ones(self.n), pw_n, -pw_n * self.logS1_n * al, -C * self.S2_n], 1)
        return pred, J


# Natural coordinates: L0 and the logs of the positive parameters.
_MODEL_PARAMS = {
    "mpl": ("L0", "A", "alpha", "B", "C", "beta", "gamma"),
    "lra": ("L0", "A", "alpha", "C"),
}
_LOG_BOUNDS = {  # bounds on log(parameter): keep exp() finite and the fit physical
    "A": (-12.0, 8.0),
    "alpha": (math.log(0.01), math.log(3.0)),
    "B": (-12.0, 16.0),
    "C": (-25.0, 12.0),
    "beta": (math.log(0.01), math.log(20.0)),
    "gamma": (math.log(0.01), math.log(GAMMA_MAX)),
}
_SCALED = ("A", "alpha", "B")  # parameters whose log is linear in log N across sizes


# ---- size law: fitted coordinates z -> per-curve natural coordinates theta ----------------------------


@dataclass
class _SizeLaw:
    """Maps the fitted vector z to each curve's theta. kind: 'none' (one size), 'two' (L0 = E +
    a (N/N_ref)^-p with p fixed, logs of A, alpha, B linear in log N) or 'many' (p fitted too)."""

    model: str
    kind: str
    log_nref: float = 0.0

    @property
    def names(self) -> list[str]:
        base = list(_MODEL_PARAMS[self.model])
        if self.kind == "none":
            return base
        out = ["E", "a"] + (["p"] if self.kind == "many" else []) + base[1:]
        out += [f"s_{k}" for k in _SCALED if k in base]
        return out

    def theta(self, z: np.ndarray, log_n: float | None) -> tuple[np.ndarray, np.ndarray]:
        """theta (P,) and dtheta/dz (P x Z) for a curve of log-size log_n."""
        names = _MODEL_PARAMS[self.model]
        P, Z = len(names), len(z)
        J = np.zeros((P, Z))
        if self.kind == "none":
            return z.copy(), np.eye(P)
        x = (log_n - self.log_nref) if log_n is not None else 0.0
        E, la = z[0], z[1]
        off = 2
        if self.kind == "many":
            p = math.exp(z[2])
            off = 3
        else:
            p = CHINCHILLA_ALPHA
        th = np.zeros(P)
        term = math.exp(la - p * x)
        th[0] = E + term
        J[0, 0], J[0, 1] = 1.0, term
        if self.kind == "many":
            J[0, 2] = -term * x * p
        for i in range(1, P):
            th[i] = z[off + i - 1]
            J[i, off + i - 1] = 1.0
        s0 = off + P - 1
        for j, k in enumerate([k for k in _SCALED if k in names]):
            i = names.index(k)
            th[i] += z[s0 + j] * x
            J[i, s0 + j] = x
        return th, J


# ---- the fit ---------------------------------------------------------------------------------------------


def _huber(r: np.ndarray, delta: float):
    a = np.abs(r)
    quad = a < delta
    return np.where(quad, 0.5 * r * r, delta * (a - 0.5 * delta)), np.where(quad, r, delta * np.sign(r))


def _objective(z, designs, ys, log_ns, law: _SizeLaw, weights):
    f = 0.0
    g = np.zeros(len(z))
    for des, y, log_n, w in zip(designs, ys, log_ns, weights):
        th, Jz = law.theta(z, log_n)
        pred, J = des.predict(th, grad=True)
        ok = pred > 1e-9
        r = np.log(y) - np.log(np.where(ok, pred, 1e-9))
        h, dh = _huber(r, HUBER_DELTA)
        wh = h if w is None else w * h
        f += float(wh.sum())
        dpred = np.where(ok, -(dh if w is None else w * dh) / np.where(ok, pred, 1.0), 0.0)
        g += (dpred @ J) @ Jz
    if not math.isfinite(f):
        return 1e30, np.zeros(len(z))
    return f, g


def _bounds(law: _SizeLaw, y_min: float) -> list[tuple[float | None, float | None]]:
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
            out.append(_LOG_BOUNDS[name])
    return out


def _lbfgs(z0, args, bounds, maxiter=4000):
    return minimize(
        _objective, z0, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
        options={"maxiter": maxiter, "maxfun": 3 * maxiter, "ftol": 1e-13, "gtol": 1e-9},
    )


def _linearised_start(designs, ys, weights=None) -> np.ndarray:
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
        h, dh = _huber(r, HUBER_DELTA)
        if w is not None:
            h, dh = w * h, w * dh
        dp = np.where(ok, -dh / np.where(ok, pred, 1.0), 0.0)
        return float(h.sum()), np.array([dp.sum(), (dp * pw).sum(), -(dp * pw * logS1).sum() * al, (dp * eta).sum() / eta_ref])

    best = None
    bnds = [(0.0, y_min), (-12.0, 8.0), _LOG_BOUNDS["alpha"], (0.0, y_min)]
    for frac in (0.5, 0.8, 0.95):
        for al in (0.3, 0.6):
            L0 = frac * y_min
            lA = math.log(max(float(np.median(y)) - L0, 1e-3)) + al * float(np.median(logS1))
            r = minimize(obj, [L0, lA, math.log(al), 0.01 * y_min], jac=True, method="L-BFGS-B", bounds=bnds,
                         options={"maxiter": 2000})
            if best is None or r.fun < best.fun:
                best = r
    return best.x


def _starts(model: str, lin: np.ndarray, eta_ref: float) -> list[np.ndarray]:
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


def _clip(z: np.ndarray, bounds) -> np.ndarray:
    lo = np.array([-np.inf if b[0] is None else b[0] for b in bounds])
    hi = np.array([np.inf if b[1] is None else b[1] for b in bounds])
    return np.clip(z, lo, hi)


def _fix(bounds, i: int, v: float):
    out = list(bounds)
    out[i] = (v, v)
    return out


def _fit_one_size(model, designs, ys, weights, eta_ref, y_min, lin=None, joint=False):
    """Fit of curves of one size: for the Multi-Power Law in two stages, B from the instant model
    (stage 1), then L0, A, alpha, C, beta, gamma with B held (stage 2). B and the slow tail of G
    trade off (a larger B with a slower-saturating G fits a few thousand steps after a drop as well
    as a smaller B with a quick one); anchoring B to the settled response estimated by the instant
    model is what extrapolates to longer horizons. Returns the best scipy result and the bounds."""
    law = _SizeLaw(model, "none")
    bounds = _bounds(law, y_min)
    if lin is None:
        lin = _linearised_start(designs, ys, weights)
    starts = _starts(model, lin, eta_ref)
    if model == "mpl" and not joint:
        lB = float(np.clip(starts[0][3], *_LOG_BOUNDS["B"]))
        bounds = _fix(bounds, 3, lB)
    args = (designs, ys, [None] * len(ys), law, weights or [None] * len(ys))
    results = [_lbfgs(_clip(z0, bounds), args, bounds) for z0 in starts]
    best = min(results, key=lambda r: r.fun if np.isfinite(r.fun) else np.inf)
    return best, results, bounds


def _sized_start(thetas: list[np.ndarray], log_ns: list[float], law: _SizeLaw) -> np.ndarray:
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
    names = _MODEL_PARAMS[law.model]
    base = th[:, 1:].mean(0)
    slopes = []
    for k in [k for k in _SCALED if k in names]:
        i = names.index(k)
        s_, c_ = np.polyfit(x, th[:, i], 1)
        base[i - 1] = c_
        slopes.append(s_)
    return np.r_[head, base, slopes]


@dataclass
class CurveFit:
    """A fitted curve model. `predict(steps, lr, params=None)` gives the loss at `steps` under
    schedule `lr` (dense per step, or one value per step) for a model of `params` parameters."""

    model: str
    names: list[str]
    z: np.ndarray
    law_kind: str = "none"
    log_nref: float = 0.0
    size_n: float | None = None  # the single training size (law 'none'), when known
    boot_z: np.ndarray | None = None  # K x Z bootstrap refits
    resid_rel_std: float = 0.0  # robust std of the relative training residuals
    extrap_rel: float = 0.0  # backtested relative error per e-fold of LR area beyond the training curves
    s1_max: float | None = None  # largest LR area (S1 + S_W) a training curve reached
    info: dict = field(default_factory=dict)
    size_prior: str = "kaplan"  # one size: how another size is predicted (module docstring)
    sizes: list = field(default_factory=list)  # the training curves' sizes (params), when given
    calib: float = 1.0  # leave-one-curve-out calibration factor of the band's non-bootstrap parts
    calibration: dict = field(default_factory=dict)  # how calib was measured
    converged: bool = True  # False when a parameter sits on a bound of its search range
    warnings: list = field(default_factory=list)

    @property
    def _law(self) -> _SizeLaw:
        return _SizeLaw(self.model, self.law_kind, self.log_nref)

    @property
    def params(self) -> dict[str, float]:
        """Fitted values in natural units (positive parameters exponentiated)."""
        out = {}
        for k, v in zip(self.names, self.z):
            out[k] = float(math.exp(v)) if k in _LOG_BOUNDS or k in ("a", "p") else float(v)
        return out

    def curve_params(self, params: float | None = None) -> dict[str, float]:
        """The curve parameters (L0, A, alpha, ...) at model size `params`."""
        th = self._theta(self.z, params)
        names = _MODEL_PARAMS[self.model]
        return {k: float(v if k == "L0" else math.exp(v)) for k, v in zip(names, th)}

    def _theta(self, z: np.ndarray, params: float | None) -> np.ndarray:
        law = self._law
        if law.kind != "none":
            if params is None:
                raise CurveError("this fit depends on model size (curves of several sizes): pass params=N")
            return law.theta(z, math.log(float(params)))[0]
        th = z.copy()
        if self.size_prior == "chinchilla" and params is not None and self.size_n is not None and float(params) != self.size_n:
            th[0] = _prior_l0(th[0], self.size_n, float(params))
        return th

    def _size_factor(self, params: float | None) -> float:
        """The Kaplan prior's ratio of losses at `params` and at the one training size."""
        if self.law_kind != "none" or self.size_prior != "kaplan" or params is None or self.size_n is None:
            return 1.0
        return (float(params) / self.size_n) ** -KAPLAN_ALPHA_N

    def size_efolds(self, params: float | None) -> float:
        """e-folds of N from `params` to the nearest training size (0 inside their range or unknown)."""
        if params is None or not self.sizes:
            return 0.0
        x = math.log(float(params))
        lo, hi = math.log(min(self.sizes)), math.log(max(self.sizes))
        return max(x - hi, lo - x, 0.0)

    def predict(self, steps, lr, params: float | None = None, _z: np.ndarray | None = None) -> np.ndarray:
        steps_n = _check_steps(steps, "predict")
        lr_T = _dense_lr(steps_n, lr, "predict")
        th = self._theta(self.z if _z is None else _z, params)
        out = np.empty(len(steps_n))
        n_blocks = len(_block_distances(int(steps_n[-1]) + 1))
        chunk = max(1, _EVAL_CHUNK // max(n_blocks, 1))
        for i in range(0, len(steps_n), chunk):
            out[i : i + chunk] = _Design(self.model, steps_n[i : i + chunk], lr_T).predict(th)
        return out * self._size_factor(params)

    def predict_curve(self, curve: Curve) -> np.ndarray:
        return self.predict(curve.step, curve.lr_per_step, params=curve.params)

    def band(self, steps, lr, params: float | None = None, level: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) around predict(), normal quantiles at `level` of parts added in quadrature: the
        training residuals' relative scatter; an extrapolation term extrap_rel x log(S1(t) / s1_max)
        beyond the largest LR area of the training curves (extrap_rel backtested on the curves
        themselves: fit on each curve's first half of LR area, error on the second half); these two
        scaled by the leave-one-curve-out calibration factor `calib`; at a size outside
        the training sizes, SIZE_PRIOR_SD per e-fold of N; and the bootstrap refits' spread."""
        pred = self.predict(steps, lr, params)
        zq = float(norm.ppf(0.5 + level / 2))
        var = self._model_var(steps, lr, params, pred) * self.calib**2 + self._size_var(params, pred)
        if self.boot_z is not None and len(self.boot_z) >= 2:
            draws = np.stack([self.predict(steps, lr, params, _z=zb) for zb in self.boot_z])
            var = var + draws.var(0, ddof=1)
        half = zq * np.sqrt(var)
        return pred - half, pred + half

    def _model_var(self, steps, lr, params, pred: np.ndarray) -> np.ndarray:
        var = (self.resid_rel_std * pred) ** 2
        if self.extrap_rel > 0 and self.s1_max:
            steps_n = _check_steps(steps, "band")
            s1_n = np.cumsum(_dense_lr(steps_n, lr, "band"))[steps_n]
            rho_n = np.maximum(np.log(np.maximum(s1_n, 1e-300) / self.s1_max), 0.0)
            var = var + (self.extrap_rel * rho_n * pred) ** 2
        return var

    def _size_var(self, params, pred: np.ndarray) -> np.ndarray:
        return (SIZE_PRIOR_SD * self.size_efolds(params) * pred) ** 2

    def predict_warnings(self, params: float | None) -> list[str]:
        """What a reader of a prediction at size `params` must know."""
        out = []
        if self.size_efolds(params) > 0:
            if self.law_kind == "none":
                out.append(f"predicting size {float(params):.3g} from one training size {self.size_n:.3g}: the size "
                           f"dependence is the {self.size_prior} prior, not fitted")
            else:
                out.append(f"size {float(params):.3g} lies {self.size_efolds(params):.2f} e-folds outside the fitted "
                           f"sizes: the size law is extrapolated")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {
            "model": self.model,
            "names": list(self.names),
            "z": [float(v) for v in self.z],
            "params": self.params,
            "law_kind": self.law_kind,
            "log_nref": self.log_nref,
            "size_n": self.size_n,
            "resid_rel_std": self.resid_rel_std,
            "extrap_rel": self.extrap_rel,
            "s1_max": self.s1_max,
            "boot_z": None if self.boot_z is None else [[float(v) for v in row] for row in self.boot_z],
            "info": self.info,
            "sizes": list(self.sizes),
            "prior": self.size_prior,
            "calib": self.calib,
            "calibration": self.calibration,
            "converged": self.converged,
            "warnings": list(self.warnings),
            "band_method": ("normal quantiles of: (relative residual scatter and extrapolation in LR area, backtested "
                            "per curve) x calib (leave-one-curve-out), "
                            f"{SIZE_PRIOR_SD} relative per e-fold of N outside the fitted sizes, and the bootstrap "
                            "refits' variance, in quadrature"),
        }
        if self.law_kind == "none":
            d["size_prior"] = (
                f"one training size: another size N gets the whole curve x (N/N_fit)^-{KAPLAN_ALPHA_N} (Kaplan et al. 2020)"
                if self.size_prior == "kaplan" else
                f"one training size: another size N gets L0(N) = E + (L0 - E) (N/N_fit)^-{CHINCHILLA_ALPHA} with "
                f"E/L0 from Chinchilla's L(N) = {CHINCHILLA_E} + {CHINCHILLA_A}/N^{CHINCHILLA_ALPHA} at N_fit; "
                "the other parameters are kept"
            )
        else:
            d["size_law"] = (
                "L0(N) = E + a (N/N_ref)^-p, log A, log alpha, log B linear in log(N/N_ref) (slopes s_*), "
                f"N_ref = {math.exp(self.log_nref):.4g}"
                + ("" if self.law_kind == "many" else f", p fixed at {CHINCHILLA_ALPHA} (two sizes)")
            )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CurveFit":
        try:
            boot = d.get("boot_z")
            return cls(
                model=d["model"],
                names=list(d["names"]),
                z=np.asarray(d["z"], dtype=np.float64),
                law_kind=d.get("law_kind", "none"),
                log_nref=float(d.get("log_nref", 0.0)),
                size_n=d.get("size_n"),
                boot_z=None if boot is None else np.asarray(boot, dtype=np.float64),
                resid_rel_std=float(d.get("resid_rel_std", 0.0)),
                extrap_rel=float(d.get("extrap_rel", 0.0)),
                s1_max=d.get("s1_max"),
                info=dict(d.get("info", {})),
                size_prior=str(d.get("prior", "chinchilla")),
                sizes=list(d.get("sizes") or []),
                calib=float(d.get("calib", 1.0)),
                calibration=dict(d.get("calibration") or {}),
                converged=bool(d.get("converged", True)),
                warnings=list(d.get("warnings") or []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CurveError(f"not a curve fit: {e}") from None


def _prior_l0(L0: float, n_fit: float, n_new: float) -> float:
    """Chinchilla-shaped L0(N) through (n_fit, L0): E + (L0 - E) (n_new/n_fit)^-alpha, E/L0 as in
    Chinchilla's L(N) at n_fit."""
    red = CHINCHILLA_A * n_fit ** -CHINCHILLA_ALPHA
    E = L0 * CHINCHILLA_E / (CHINCHILLA_E + red)
    return E + (L0 - E) * (n_new / n_fit) ** -CHINCHILLA_ALPHA


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
    size_prior: str = "kaplan",
    calibrate: bool | None = None,
    level: float = 0.9,
) -> CurveFit:
    """Fit `model` ("mpl" or "lra") to `curves` with shared parameters (a size law across sizes when
    the curves carry several `params` values). n_boot > 0 adds block-bootstrap refits for bands.
    joint=True fits the Multi-Power Law's B together with the rest (one stage) instead of from the
    instant model; exact=True evaluates LD term by term (slow; for checking the lumping).
    size_prior: "kaplan" or "chinchilla", how a one-size fit predicts another size. calibrate (default:
    with n_boot > 0) measures the band's calibration factor leave-one-curve-out at `level`.
    Raises CurveError for unusable input, CurveFitError when the fit does not converge."""
    if size_prior not in SIZE_PRIORS:
        raise CurveError(f"unknown size prior {size_prior!r}; choose one of {', '.join(SIZE_PRIORS)}")
    if not 0 < level < 1:
        raise CurveError(f"level must be in (0, 1), got {level}")
    calibrate = n_boot > 0 if calibrate is None else calibrate
    # L-BFGS-B makes thousands of tiny BLAS calls; a multi-threaded BLAS spins its threads on each
    # one and on a busy machine runs many times slower than one thread.
    if threadpool_limits is None:
        fit = _fit_curves(curves, model, n_boot, seed, joint, exact)
        return _finish(fit, curves, model, joint, size_prior, calibrate, level)
    with threadpool_limits(limits=1, user_api="blas"):
        fit = _fit_curves(curves, model, n_boot, seed, joint, exact)
        return _finish(fit, curves, model, joint, size_prior, calibrate, level)


def _finish(fit: CurveFit, curves, model, joint, size_prior, calibrate, level) -> CurveFit:
    """The size prior, the band's calibration and the warnings."""
    fit.size_prior = size_prior
    fit.sizes = list(fit.info.get("sizes") or [])
    if fit.law_kind == "none":
        fit.warnings.append("one training size: a prediction at another size rests on the "
                            f"{size_prior} prior (analysis.curves), not on this data")
    elif fit.law_kind == "two":
        fit.warnings += fitwarn.too_few_sizes(2, "sizes for the size law")
    if calibrate:
        fit.calib, fit.calibration = _calibrate(fit, list(curves), model, joint, size_prior, level)
        if fit.calibration.get("n_points", 0) == 0:
            fit.warnings.append(f"band not calibrated: {fit.calibration.get('why', 'no curve could be left out')}")
    if fit.boot_z is not None and len(fit.boot_z) >= 4:
        nat = np.array([_natural_row(fit.names, z) for z in fit.boot_z])
        ci = {k: list(np.quantile(nat[:, i], [0.05, 0.95])) for i, k in enumerate(fit.names)}
        pos = [k for k in fit.names if k in _LOG_BOUNDS or k in ("a", "p")]
        fit.warnings += fitwarn.bootstrap_disagreement(ci, len(fit.boot_z), 0, positive=pos)
    fit.info["converged"] = fit.converged
    return fit


def _bound_warnings(names, z, bounds) -> list[str]:
    """Parameters on a bound of their search range, in natural units (fixed ones left out)."""
    out = []
    for k, v, (lo, hi) in zip(names, z, bounds):
        if lo is not None and hi is not None and lo >= hi:
            continue
        logged = k in _LOG_BOUNDS or k in ("a", "p")
        nat = (lambda x: math.exp(x)) if logged else (lambda x: x)
        w = fitwarn.at_bounds({k: v}, {k: (lo, hi)})
        if w:
            side = "lower" if "lower" in w[0] else "upper"
            b = lo if side == "lower" else hi
            out.append(f"{k} = {nat(v):.4g} is at its {side} bound {nat(b):.4g}: the optimum may lie beyond it")
    return out


def _natural_row(names, z) -> list[float]:
    return [float(math.exp(v)) if k in _LOG_BOUNDS or k in ("a", "p") else float(v) for k, v in zip(names, z)]


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
            sub = _fit_curves(rest, model, 0, 0, joint, False)
            designs = [_Design(model, x.step, x.lr_per_step) for x in rest]
            sub.extrap_rel = _backtest_extrapolation(rest, designs, model, joint)
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


def _fit_curves(curves, model, n_boot, seed, joint, exact) -> CurveFit:
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
    law = _SizeLaw(model, kind, log_nref)
    n_points = sum(len(c.step) for c in curves)
    n_free = len(law.names)
    if model == "mpl" and not joint:
        n_free -= 1 if kind == "none" else 2  # B (and its slope in log N) come from the instant model
    if n_points <= n_free:
        raise CurveError(f"{n_points} points in all, but the {model} fit has {n_free} parameters: need more points")

    designs = [_Design(model, c.step, c.lr_per_step, exact=exact) for c in curves]
    ys = [c.loss for c in curves]
    log_ns = [math.log(c.params) if c.params is not None else None for c in curves]
    y_min = min(float(y.min()) for y in ys)
    eta_ref = max(float(c.lr_per_step[: c.step[-1] + 1].max()) for c in curves)

    if kind == "none":
        best, results, bounds = _fit_one_size(model, designs, ys, None, eta_ref, y_min, joint=joint)
        fixed = {}
    else:
        # one fit per size seeds the size law; B and its slope in log N come from those fits
        thetas = []
        for n in sizes:
            idx = [i for i, c in enumerate(curves) if c.params == n]
            r, _, _ = _fit_one_size(model, [designs[i] for i in idx], [ys[i] for i in idx], None, eta_ref,
                                    min(float(ys[i].min()) for i in idx), joint=joint)
            thetas.append(r.x)
        z0 = _sized_start(thetas, [math.log(n) for n in sizes], law)
        bounds = _bounds(law, y_min)
        fixed = {}
        if model == "mpl" and not joint:
            for name in ("B", "s_B"):
                i = law.names.index(name)
                fixed[i] = float(z0[i])
                bounds = _fix(bounds, i, float(z0[i]))
        args = (designs, ys, log_ns, law, [None] * len(ys))
        results = [_lbfgs(_clip(z0, bounds), args, bounds)]
        best = results[0]
    if not np.all(np.isfinite(best.x)) or not np.isfinite(best.fun) or best.fun >= 1e29:
        raise CurveFitError(f"the {model} curve fit did not converge (no finite solution)")
    converged = any(r.success for r in results if abs(r.fun - best.fun) <= 1e-6 * max(abs(best.fun), 1e-12))
    if not converged:
        raise CurveFitError(f"the {model} curve fit did not converge: {best.message}")

    fit = CurveFit(model=model, names=law.names, z=best.x, law_kind=kind, log_nref=log_nref,
                   size_n=sizes[0] if len(sizes) == 1 else None)
    fit.warnings += _bound_warnings(law.names, best.x, bounds)
    fit.converged = not fit.warnings
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
        fit.extrap_rel = _backtest_extrapolation(curves, designs, model, joint)

    fit.info = {
        "objective": float(best.fun),
        "n_points": n_points,
        "n_curves": len(curves),
        "sizes": sizes,
        "iterations": int(best.nit),
        "converged": fit.converged,
        "train": per_curve,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    return fit


def _backtest_extrapolation(curves, designs, model, joint) -> float:
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
        bt = _fit_curves(early, model, 0, 0, joint, False)
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
            lin = _linearised_start(designs, ys, w)
            lB = float(np.clip(math.log(max(lin[3], 1e-6) / eta_ref), *_LOG_BOUNDS["B"]))
            bnd = _fix(bounds, 3, lB)
        r = _lbfgs(_clip(z, bnd), (designs, ys, log_ns, law, w), bnd, maxiter=1000)
        if np.all(np.isfinite(r.x)) and r.fun < 1e29:
            boots.append(r.x)
    return np.asarray(boots) if boots else None
