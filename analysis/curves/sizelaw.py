"""How the curve models' parameters depend on model size: the size law mapping a fit's coordinates
to each curve's parameters (several sizes), and the one-size priors (analysis.curves.fit states them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.curves.design import MODEL_PARAMS, SCALED

SIZE_LAWS = {"slopes": SCALED, "additive": ()}  # additive: only L0 moves with N (Chinchilla's additive form)

__all__ = ["SIZE_LAWS", "CHINCHILLA_E", "CHINCHILLA_A", "CHINCHILLA_ALPHA", "KAPLAN_ALPHA_N", "SIZE_PRIORS", "SIZE_PRIOR_SD",
           "SizeLaw", "prior_l0"]

CHINCHILLA_E, CHINCHILLA_A, CHINCHILLA_ALPHA = 1.69, 406.4, 0.34
KAPLAN_ALPHA_N = 0.076
SIZE_PRIORS = ("kaplan-floor", "kaplan", "chinchilla")
SIZE_PRIOR_SD = 0.03  # relative loss sd per e-fold of N away from the fitted sizes


@dataclass
class SizeLaw:
    """Maps the fitted vector z to each curve's theta. kind: 'none' (one size), 'two' (L0 = E +
    a (N/N_ref)^-p with p fixed, logs of A, alpha, B linear in log N) or 'many' (p fitted too)."""

    model: str
    kind: str
    log_nref: float = 0.0
    scaled: tuple[str, ...] = SCALED  # parameters whose log is linear in log N; () for the additive law

    @property
    def names(self) -> list[str]:
        base = list(MODEL_PARAMS[self.model])
        if self.kind == "none":
            return base
        out = ["E", "a"] + (["p"] if self.kind == "many" else []) + base[1:]
        out += [f"s_{k}" for k in self.scaled if k in base]
        return out

    def theta(self, z: np.ndarray, log_n: float | None) -> tuple[np.ndarray, np.ndarray]:
        """theta (P,) and dtheta/dz (P x Z) for a curve of log-size log_n."""
        names = MODEL_PARAMS[self.model]
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
        for j, k in enumerate([k for k in self.scaled if k in names]):
            i = names.index(k)
            th[i] += z[s0 + j] * x
            J[i, s0 + j] = x
        return th, J



def prior_l0(L0: float, n_fit: float, n_new: float) -> float:
    """Chinchilla-shaped L0(N) through (n_fit, L0): E + (L0 - E) (n_new/n_fit)^-alpha, E/L0 as in
    Chinchilla's L(N) at n_fit."""
    red = CHINCHILLA_A * n_fit ** -CHINCHILLA_ALPHA
    E = L0 * CHINCHILLA_E / (CHINCHILLA_E + red)
    return E + (L0 - E) * (n_new / n_fit) ** -CHINCHILLA_ALPHA
