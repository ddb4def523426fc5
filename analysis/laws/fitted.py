"""The fitted scaling laws (analysis.laws.fit fits them and describes the method): L(N, D), the
compute envelope L(C) and the MoE form, each a sum of power terms plus a floor, with its prediction
interval for a held-out point and its JSON; compute-optimal N*, D* for a budget.

Shape legend: Q parameters (2K+1), K power terms, R data rows, B bootstrap draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Sequence

import numpy as np
from scipy.special import ndtri  # the normal quantile (scipy.stats costs a CLI run ~0.4 s to import)

from core.errors import InputError

__all__ = ["HUBER_DELTA", "FitError", "LawFit", "EnvelopeFit", "MoELawFit", "compute_optimal"]

HUBER_DELTA = 1e-3


class FitError(InputError):
    """The data cannot be fitted (too few points, no spread) or the fit did not converge."""


def _quantiles(v_B: np.ndarray, level: float) -> list[float]:
    lo, hi = np.quantile(v_B, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


@dataclass
class _PowerFit:
    """Common core of LawFit and EnvelopeFit. `draws` holds bootstrap refits, one row each,
    in the natural parameters (E, A_1.., alpha_1..)."""

    params: dict[str, float]
    ci: dict[str, list[float]]
    draws: np.ndarray = field(repr=False)
    n_points: int
    loss: float
    converged: bool
    level: float
    n_bootstrap: int
    n_bootstrap_failed: int
    seconds: float
    message: str = ""
    huber_delta: float = HUBER_DELTA
    warnings: list[str] = field(default_factory=list)
    resid_sd: float = 0.0  # robust sd of the log residuals, inflated by n / (n - Q)
    sizes: int = 0  # distinct values of the first variable (model sizes, or compute budgets)
    x_max: float = math.inf  # largest value of the first variable in the data
    extrap_sd: float = 0.0  # log-loss sd per e-fold of the first variable beyond x_max (backtested)
    # the extrapolation backtest's own fit (natural parameters): with `params`, a warm start for refits
    # of nearby data (`start=` of fit_law, fit_envelope, fit_moe_law)
    sub_params: dict[str, float] | None = field(default=None, repr=False)

    _TERMS: ClassVar[tuple[str, ...]] = ()
    _EXPS: ClassVar[tuple[str, ...]] = ()
    _LAW: ClassVar[str] = ""
    _KIND: ClassVar[str] = ""

    def __getattr__(self, name: str) -> float:
        params = self.__dict__.get("params", {})
        if name in params:
            return params[name]
        raise AttributeError(name)

    def _vector(self) -> np.ndarray:
        return np.array([self.params[k] for k in ("E", *self._TERMS, *self._EXPS)])

    def _eval(self, theta_Q: np.ndarray, xs: Sequence[np.ndarray]) -> np.ndarray:
        K = len(self._TERMS)
        out = theta_Q[..., 0, None] * np.ones_like(xs[0])
        for k in range(K):
            out = out + theta_Q[..., 1 + k, None] * xs[k] ** (-theta_Q[..., 1 + K + k, None])
        return out

    def _predict(self, xs: Sequence[Any], level: float | None) -> dict[str, Any]:
        arrs = [np.asarray(x, dtype=np.float64) for x in xs]
        scalar = all(a.ndim == 0 for a in arrs)
        arrs = [a.reshape(-1) for a in np.broadcast_arrays(*arrs)]
        if any(np.any(a <= 0) or not np.all(np.isfinite(a)) for a in arrs):
            raise ValueError("predict: inputs must be positive and finite")
        point = self._eval(self._vector(), arrs)
        level = self.level if level is None else level
        if len(self.draws):
            with np.errstate(invalid="ignore", divide="ignore"):
                logd_BR = np.log(self._eval(self.draws, arrs))
            var_R = np.nanvar(logd_BR, axis=0) + self.resid_sd**2 + self._extrap_var(arrs)
            half = float(ndtri(0.5 + level / 2)) * np.sqrt(var_R)
            lo, hi = point * np.exp(-half), point * np.exp(half)
        else:
            lo = hi = np.full_like(point, np.nan)
        if scalar:
            return {"loss": float(point[0]), "lo": float(lo[0]), "hi": float(hi[0])}
        return {"loss": point, "lo": lo, "hi": hi}

    def _extrap_var(self, arrs: Sequence[np.ndarray]) -> np.ndarray | float:
        """The backtested extrapolation term's variance (log loss) at points beyond the data."""
        rho_R = np.maximum(np.log(arrs[0] / self.x_max), 0.0) if math.isfinite(self.x_max) else 0.0
        return (self.extrap_sd * rho_R) ** 2

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"law": self._LAW, "kind": self._KIND}
        d.update({k: float(v) for k, v in self.params.items()})
        d["ci"] = {k: list(v) for k, v in self.ci.items()}
        d.update(
            ci_level=self.level,
            n_points=self.n_points,
            loss=self.loss,
            huber_delta=self.huber_delta,
            converged=self.converged,
            n_bootstrap=self.n_bootstrap,
            n_bootstrap_failed=self.n_bootstrap_failed,
            seconds=self.seconds,
            warnings=list(self.warnings),
            resid_sd=self.resid_sd,
            x_max=self.x_max,
            extrap_sd=self.extrap_sd,
            interval=("prediction interval for a held-out point, on log loss: the bootstrap refits' spread, the "
                      "points' robust residual scatter and, beyond the largest fitted x, extrap_sd per e-fold of "
                      "x (backtested: refit on x <= max/4, error on the rest; for L(N, D) the larger of that and "
                      "extrap_sd_c per e-fold of compute C = 6ND beyond c_max), added in quadrature"),
            draws=[[float(v) for v in row] for row in self.draws],
        )
        if self.message:
            d["message"] = self.message
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "_PowerFit":
        """A fit read back from its to_dict() JSON (predictions need only parameters and draws)."""
        keys = ("E", *cls._TERMS, *cls._EXPS)
        try:
            params = {k: float(d[k]) for k in keys}
            draws = np.asarray(d.get("draws") or [], dtype=np.float64).reshape(-1, len(keys))
            return cls(
                params=params, ci={k: list(v) for k, v in d.get("ci", {}).items()}, draws=draws,
                n_points=int(d.get("n_points", 0)), loss=float(d.get("loss", math.nan)),
                converged=bool(d.get("converged", False)), level=float(d.get("ci_level", 0.95)),
                n_bootstrap=int(d.get("n_bootstrap", len(draws))), n_bootstrap_failed=int(d.get("n_bootstrap_failed", 0)),
                seconds=float(d.get("seconds", 0.0)), message=str(d.get("message", "")),
                huber_delta=float(d.get("huber_delta", HUBER_DELTA)), warnings=list(d.get("warnings", [])),
                resid_sd=float(d.get("resid_sd", 0.0)), x_max=float(d.get("x_max") or math.inf),
                extrap_sd=float(d.get("extrap_sd", 0.0)),
                **({"extrap_sd_c": float(d.get("extrap_sd_c", 0.0)), "c_max": float(d.get("c_max") or math.inf)}
                   if "extrap_sd_c" in {f.name for f in fields(cls)} else {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FitError(f"not a {cls._LAW} fit: {e}") from None


@dataclass
class LawFit(_PowerFit):
    """L(N, D) = E + A/N^alpha + B/D^beta.

    Beyond the data a prediction's interval carries the larger of two backtested extrapolation terms:
    extrap_sd per e-fold of N beyond x_max, and extrap_sd_c per e-fold of compute C = 6ND beyond c_max
    (refit on the budgets up to c_max/4, error on the rest): on an IsoFLOP grid a forecast of a larger
    budget's compute-optimal loss extrapolates in C, often at an N inside the data."""

    extrap_sd_c: float = 0.0
    c_max: float = math.inf

    _TERMS: ClassVar[tuple[str, ...]] = ("A", "B")
    _EXPS: ClassVar[tuple[str, ...]] = ("alpha", "beta")
    _LAW: ClassVar[str] = "L(N, D) = E + A/N^alpha + B/D^beta"
    _KIND: ClassVar[str] = "law"

    def predict(self, N, D, level: float | None = None) -> dict[str, Any]:
        """Loss at (N, D) with a bootstrap interval: {"loss", "lo", "hi"} (floats or arrays)."""
        return self._predict([N, D], level)

    def _extrap_var(self, arrs: Sequence[np.ndarray]) -> np.ndarray | float:
        var_n = super()._extrap_var(arrs)
        if not math.isfinite(self.c_max) or len(arrs) < 2:
            return var_n
        rho_c = np.maximum(np.log(6.0 * arrs[0] * arrs[1] / self.c_max), 0.0)
        return np.maximum(var_n, (self.extrap_sd_c * rho_c) ** 2)

    def compute_optimal(self, C, level: float | None = None) -> dict[str, Any]:
        """Loss-minimising N*, D* (and the loss there) for a training budget of C = 6ND FLOPs, N* and D*
        with a bootstrap interval, the loss with a prediction interval like predict's (the refits' spread
        of L*, the residual scatter and the extrapolation terms, on log loss)."""
        level = self.level if level is None else level
        point = compute_optimal(self._vector(), C)
        out: dict[str, Any] = {}
        draws = compute_optimal(self.draws, C) if len(self.draws) else None
        scalar = np.ndim(C) == 0
        for key in ("N", "D", "loss"):
            out[key] = point[key]
            if draws is None:
                continue
            if key == "loss":
                Ns, Ds = (np.atleast_1d(np.asarray(point[k], dtype=np.float64)).reshape(-1) for k in ("N", "D"))
                with np.errstate(invalid="ignore", divide="ignore"):
                    var = np.nanvar(np.log(draws["loss"]), axis=0) + self.resid_sd**2 + self._extrap_var([Ns, Ds])
                half = float(ndtri(0.5 + level / 2)) * np.sqrt(var)
                L = np.atleast_1d(np.asarray(point["loss"], dtype=np.float64)).reshape(-1)
                lo, hi = L * np.exp(-half), L * np.exp(half)
            else:
                lo, hi = np.quantile(draws[key], [(1 - level) / 2, (1 + level) / 2], axis=0)
            out[f"{key}_ci"] = [float(lo[0]), float(hi[0])] if scalar else [lo, hi]
        return out

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.update(extrap_sd_c=self.extrap_sd_c, c_max=self.c_max)
        # L*(C) along the compute-optimal frontier falls as C^-(alpha*beta/(alpha+beta)).
        a, b = self.params["alpha"], self.params["beta"]
        d["optimal_N_exponent"] = b / (a + b)
        d["optimal_D_exponent"] = a / (a + b)
        return d


@dataclass
class EnvelopeFit(_PowerFit):
    """L(C) = E + A*C^-alpha, the loss of the best run at each compute budget."""

    _TERMS: ClassVar[tuple[str, ...]] = ("A",)
    _EXPS: ClassVar[tuple[str, ...]] = ("alpha",)
    _LAW: ClassVar[str] = "L(C) = E + A*C^-alpha"
    _KIND: ClassVar[str] = "envelope"

    def predict(self, C, level: float | None = None) -> dict[str, Any]:
        return self._predict([C], level)


@dataclass
class MoELawFit(_PowerFit):
    """L(N_active, N_total, D) = E + A/N_active^alpha + G/N_total^gamma + B/D^beta: active parameters
    set the compute per token, total parameters the capacity; a dense model has N_total = N_active."""

    _TERMS: ClassVar[tuple[str, ...]] = ("A", "G", "B")
    _EXPS: ClassVar[tuple[str, ...]] = ("alpha", "gamma", "beta")
    _LAW: ClassVar[str] = "L(N_active, N_total, D) = E + A/N_active^alpha + G/N_total^gamma + B/D^beta"
    _KIND: ClassVar[str] = "moe"

    def predict(self, N_active, N_total, D, level: float | None = None) -> dict[str, Any]:
        return self._predict([N_active, N_total, D], level)


def compute_optimal(theta, C) -> dict[str, np.ndarray | float]:
    """N*, D*, L* minimising E + A/N^alpha + B/D^beta subject to 6ND = C.

    theta: (..., 5) natural parameters (E, A, B, alpha, beta); rows broadcast against C.
    Setting dL/dN = 0 along D = C/(6N) gives N* = G (C/6)^(beta/(alpha+beta)), D* = (C/6) / N*,
    with G = (alpha A / (beta B))^(1/(alpha+beta)).
    """
    theta = np.asarray(theta, dtype=np.float64)
    C_arr = np.asarray(C, dtype=np.float64)
    if np.any(C_arr <= 0):
        raise ValueError("compute budget C must be positive")
    E, A, B, alpha, beta = (theta[..., i, None] for i in range(5))
    c = C_arr.reshape(-1) / 6.0
    G = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
    N = G * c ** (beta / (alpha + beta))
    D = c / N
    L = E + A * N**-alpha + B * D**-beta
    out = {"N": N, "D": D, "loss": L}
    if theta.ndim == 1 and C_arr.ndim == 0:
        return {k: float(v.reshape(-1)[0]) for k, v in out.items()}
    if theta.ndim == 1:
        return {k: v.reshape(C_arr.shape) for k, v in out.items()}
    return out
