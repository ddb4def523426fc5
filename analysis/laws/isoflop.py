"""Chinchilla's approach 2 (Hoffmann et al. 2022, section 3.2): IsoFLOP profiles.

Runs are grouped by training budget C (one group per budget: runs whose log10 C lie within `tol`
decades of their neighbours). In each group a parabola in log N is fitted to the loss; its vertex is
the loss-optimal size N*(C), and D*(C) = C / (6 N*). Power laws N* = k_N C^a and D* = k_D C^b are then
fitted by least squares in log-log, with standard errors from the regression (a + b = 1 by
construction). Groups are left out, with a warning each, when they have fewer than 3 sizes, a
parabola that opens downward, or a vertex outside the sizes they sampled.

Shape legend: R runs, G groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from analysis import fitwarn
from core.errors import InputError

__all__ = ["IsoflopError", "IsoflopFit", "group_budgets", "fit_isoflop"]


class IsoflopError(InputError):
    """Data that cannot give IsoFLOP minima; the message says why."""


def group_budgets(C_R: np.ndarray, tol: float = 0.05) -> np.ndarray:
    """Group index per run: sorted log10 C split where the gap to the neighbour exceeds `tol` decades."""
    lc = np.log10(np.asarray(C_R, dtype=np.float64))
    order = np.argsort(lc)
    gid = np.empty(len(lc), dtype=np.int64)
    g = 0
    for j, i in enumerate(order):
        if j and lc[i] - lc[order[j - 1]] > tol:
            g += 1
        gid[i] = g
    return gid


@dataclass
class IsoflopFit:
    minima: list[dict[str, float]]
    a: float
    b: float
    a_se: float
    b_se: float
    log_kn: float
    warnings: list[str] = field(default_factory=list)

    def optimal(self, C: float) -> dict[str, float]:
        N = math.exp(self.log_kn) * C**self.a
        return {"C": C, "N": N, "D": C / (6.0 * N)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": "IsoFLOP profiles (Chinchilla approach 2): a parabola in log N per budget, its vertex N*(C); "
                      "N* = k C^a and D* = C / (6 N*) fitted in log-log",
            "minima": self.minima,
            "a": self.a, "a_se": self.a_se, "b": self.b, "b_se": self.b_se,
            "k_N": math.exp(self.log_kn), "k_D": math.exp(-self.log_kn) / 6.0,
            "n_budgets": len(self.minima),
            "warnings": list(self.warnings),
            "converged": not any("parabola" in w or "outside" in w for w in self.warnings) and len(self.minima) >= 3,
        }


def fit_isoflop(N_R, C_R, loss_R, *, tol: float = 0.05) -> IsoflopFit:
    N_R, C_R, loss_R = (np.asarray(a, dtype=np.float64) for a in (N_R, C_R, loss_R))
    if not (len(N_R) == len(C_R) == len(loss_R)):
        raise IsoflopError("N, C and loss must have one value per run")
    if np.any(~np.isfinite(np.r_[N_R, C_R, loss_R])) or np.any(np.r_[N_R, C_R, loss_R] <= 0):
        raise IsoflopError("N, C and loss must be positive and finite")
    gid_R = group_budgets(C_R, tol)
    minima, warnings = [], []
    for g in range(int(gid_R.max()) + 1):
        m = gid_R == g
        C = float(np.exp(np.mean(np.log(C_R[m]))))
        x, y = np.log(N_R[m]), loss_R[m]
        if len(np.unique(np.round(x, 9))) < 3:
            warnings.append(f"budget {C:.3g}: {int(m.sum())} run(s) of {len(np.unique(np.round(x, 9)))} size(s), "
                            "a parabola needs 3: left out")
            continue
        c2, c1, c0 = np.polyfit(x, y, 2)
        if c2 <= 0:
            warnings.append(f"budget {C:.3g}: the loss parabola opens downward (no minimum): left out")
            continue
        xv = -c1 / (2 * c2)
        if not x.min() <= xv <= x.max():
            warnings.append(f"budget {C:.3g}: the minimum N* = {math.exp(xv):.3g} lies outside the sampled sizes "
                            f"({math.exp(x.min()):.3g} to {math.exp(x.max()):.3g}): left out")
            continue
        Nv = math.exp(xv)
        minima.append({"C": C, "N": Nv, "D": C / (6 * Nv), "loss": float(c0 + c1 * xv + c2 * xv * xv),
                       "runs": int(m.sum())})
    if len(minima) < 2:
        raise IsoflopError(f"{len(minima)} budget(s) with a usable minimum; IsoFLOP scaling needs at least 2 "
                           + (f"({'; '.join(warnings)})" if warnings else ""))
    warnings += fitwarn.too_few_sizes(len(minima), "budgets with a minimum")
    lc = np.log([r["C"] for r in minima])
    ln = np.log([r["N"] for r in minima])
    A = np.stack([lc, np.ones_like(lc)], 1)
    coef, *_ = np.linalg.lstsq(A, ln, rcond=None)
    a, log_kn = float(coef[0]), float(coef[1])
    dof = len(lc) - 2
    if dof > 0:
        s2 = float(np.sum((ln - A @ coef) ** 2)) / dof
        a_se = math.sqrt(s2 / float(np.sum((lc - lc.mean()) ** 2)))
    else:
        a_se = math.nan
        warnings.append("2 budgets for 2 parameters: the exponent has no error estimate")
    return IsoflopFit(minima, a, 1.0 - a, a_se, a_se, log_kn, warnings)
