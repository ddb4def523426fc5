"""Schedule features of a curve for the curve models: everything that does not depend on the
models' parameters, and each model's prediction (with its Jacobian) from them.

The Multi-Power Law's loss drop LD over all logged steps is O(T x n) exactly; here the LR changes far
behind an evaluated step are lumped: changes within DENSE_STEPS steps of t enter one by one, older
ones in blocks whose width grows geometrically with the distance (ratio BLOCK_RATIO), each block a
single change at its |change|-weighted mean log-LR and position (analysis.curves.fit explains why the
error stays near 1e-5 of the loss).

Shape legend: n evaluated steps, T steps of a dense schedule, b lumped LR-change blocks per step,
P model parameters (7 mpl / 4 lra).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.signal import lfilter

from analysis.curves.data import CurveError

__all__ = ["MODELS", "MODEL_PARAMS", "LOG_BOUNDS", "SCALED", "GAMMA_MAX", "Design", "block_distances", "lumped_changes"]

MODELS = ("mpl", "lra")
DENSE_STEPS = 32  # LR changes this close to an evaluated step enter LD one by one
BLOCK_RATIO = 1.0 / 8  # farther ones in blocks of width ~ distance * BLOCK_RATIO
LRA_MOMENTUM = 0.999  # Tissue et al.'s lambda
GAMMA_MAX = 1.0
EVAL_CHUNK = 1 << 21  # (evaluated steps x blocks) per chunk when predicting long dense curves


def block_distances(T: int) -> np.ndarray:
    d = list(range(DENSE_STEPS + 1))
    x = float(DENSE_STEPS)
    while d[-1] < T:
        x = max(x * (1.0 + BLOCK_RATIO), d[-1] + 1.0)
        d.append(int(math.ceil(x)))
    return np.asarray(d, dtype=np.int64)


def lumped_changes(steps_n: np.ndarray, eta_T: np.ndarray, exact: bool = False):
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
        dist = block_distances(int(steps_n[-1]) + 1)
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


class Design:
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
            self.D_nb, self.le_nb, self.lS_nb = lumped_changes(steps_n, eta_T, exact)
            self.D_n = self.D_nb.sum(1)
        else:
            d_T = np.zeros_like(eta_T)
            d_T[1:] = eta_T[:-1] - eta_T[1:]
            inc = np.flatnonzero(d_T[1:] > 0)  # warmup = the initial non-decreasing run
            d_T[: inc[0] + 1 if len(inc) else len(d_T)] = 0.0
            m_T = lfilter([1.0], [1.0, -LRA_MOMENTUM], d_T)
            self.S2_n = np.cumsum(m_T)[steps_n]

    def predict(self, th: np.ndarray, grad: bool = False):
        """pred_n (and dpred/dtheta, n x P) for natural-coordinate theta (see MODEL_PARAMS)."""
        if self.model == "mpl":
            L0, lA, lal, lB, lC, lbe, lga = th
            A, al, B, be, ga = np.exp([lA, lal, lB, lbe, lga])
            pw_n = np.exp(lA - al * self.logS1_n)
            if self.D_nb.shape[1] == 0:
                LD_n = np.zeros(self.n)
                dC_n = dbe_n = dga_n = LD_n
            else:
                a_nb = lC - ga * self.le_nb + self.lS_nb
                # log(1 + e^a) and the logistic e^a / (1 + e^a) from one exp(-|a|), stable both ways
                e_nb = np.exp(-np.abs(a_nb))
                logu_nb = np.maximum(a_nb, 0.0) + np.log1p(e_nb)
                omG_nb = np.exp(-be * logu_nb)
                DomG_nb = self.D_nb * omG_nb
                LD_n = self.D_n - DomG_nb.sum(1)
                if grad:
                    sig_nb = np.where(a_nb >= 0.0, 1.0, e_nb) / (1.0 + e_nb)
                    w_nb = np.multiply(DomG_nb, sig_nb, out=sig_nb)  # dG/dlogC over be, weighted
                    dC_n = w_nb.sum(1) * be
                    dga_n = -np.einsum("nb,nb->n", w_nb, self.le_nb) * (be * ga)
                    dbe_n = np.einsum("nb,nb->n", DomG_nb, logu_nb) * be
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
MODEL_PARAMS = {
    "mpl": ("L0", "A", "alpha", "B", "C", "beta", "gamma"),
    "lra": ("L0", "A", "alpha", "C"),
}
LOG_BOUNDS = {  # bounds on log(parameter): keep exp() finite and the fit physical
    "A": (-12.0, 8.0),
    "alpha": (math.log(0.01), math.log(3.0)),
    "B": (-12.0, 16.0),
    "C": (-25.0, 12.0),
    "beta": (math.log(0.01), math.log(20.0)),
    "gamma": (math.log(0.01), math.log(GAMMA_MAX)),
}
SCALED = ("A", "alpha", "B")  # parameters whose log is linear in log N across sizes
