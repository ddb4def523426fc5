"""A fitted loss-curve model (analysis.curves.fit fits it): its prediction of a curve under any schedule
and at any model size (the size law, or a one-size prior), its band, its warnings and its JSON.

Shape legend: n evaluated steps, P model parameters, Z fitted coordinates, K bootstrap draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

from analysis.curves.data import Curve, CurveError, check_steps, dense_lr
from analysis.curves.design import EVAL_CHUNK, LOG_BOUNDS, MODEL_PARAMS, Design, block_distances
from analysis.curves import sizeband
from analysis.curves.sizeband import size_halfwidth
from analysis.curves.sizelaw import (CHINCHILLA_A, CHINCHILLA_ALPHA, CHINCHILLA_E, KAPLAN_ALPHA_N, SIZE_LAWS,
                                    SIZE_PRIOR_SD, SizeLaw, prior_l0)

__all__ = ["CurveFit"]


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
    size_prior: str = "kaplan-floor"  # one size: how another size is predicted (module docstring)
    floor_free: bool = True  # L0 is inside its search range (the kaplan-floor prior needs a measured floor)
    size_law: str = "additive"  # several sizes: "additive" (only L0 moves with N) or "slopes" (log A, log alpha,
    # log B linear in log N too)
    sizes: list = field(default_factory=list)  # the training curves' sizes (params), when given
    calib: float = 1.0  # leave-one-curve-out calibration factor of the band's non-bootstrap parts
    # relative loss sd per e-fold of N beyond the fitted sizes, measured by the fit's own size backtest
    # (analysis.curves.fit: each size beyond the smallest predicted from the smaller ones); None: the prior
    size_sd: float | None = None
    size_backtest: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # how calib was measured
    converged: bool = True  # False when a parameter sits on a bound of its search range
    warnings: list = field(default_factory=list)

    @property
    def _law(self) -> SizeLaw:
        return SizeLaw(self.model, self.law_kind, self.log_nref, SIZE_LAWS[self.size_law])

    @property
    def params(self) -> dict[str, float]:
        """Fitted values in natural units (positive parameters exponentiated)."""
        out = {}
        for k, v in zip(self.names, self.z):
            out[k] = float(math.exp(v)) if k in LOG_BOUNDS or k in ("a", "p") else float(v)
        return out

    def curve_params(self, params: float | None = None) -> dict[str, float]:
        """The curve parameters (L0, A, alpha, ...) at model size `params`."""
        th = self._theta(self.z, params)
        names = MODEL_PARAMS[self.model]
        return {k: float(v if k == "L0" else math.exp(v)) for k, v in zip(names, th)}

    def _theta(self, z: np.ndarray, params: float | None) -> np.ndarray:
        law = self._law
        if law.kind != "none":
            if params is None:
                raise CurveError("this fit depends on model size (curves of several sizes): pass params=N")
            return law.theta(z, math.log(float(params)))[0]
        th = z.copy()
        if self.size_prior == "chinchilla" and params is not None and self.size_n is not None and float(params) != self.size_n:
            th[0] = prior_l0(th[0], self.size_n, float(params))
        return th

    def _size_ratio(self, params: float | None) -> float:
        """Kaplan's L(N) ratio (N / N_fit)^-0.076 of a one-size fit; 1 when it does not apply."""
        if self.law_kind != "none" or not self.size_prior.startswith("kaplan") or params is None or self.size_n is None:
            return 1.0
        return (float(params) / self.size_n) ** -KAPLAN_ALPHA_N

    @property
    def _scales_floor(self) -> bool:
        """The kaplan-floor prior moves L0 alone when the fit measured it (not on a bound)."""
        return self.size_prior == "kaplan-floor" and self.floor_free

    def _apply_size_prior(self, pred_n: np.ndarray, th: np.ndarray, params: float | None) -> np.ndarray:
        r = self._size_ratio(params)
        if r == 1.0:
            return pred_n
        if self._scales_floor:
            return pred_n + th[0] * (r - 1.0)
        return pred_n * r

    def size_efolds(self, params: float | None) -> float:
        """e-folds of N from `params` to the nearest training size (0 inside their range or unknown)."""
        if params is None or not self.sizes:
            return 0.0
        x = math.log(float(params))
        lo, hi = math.log(min(self.sizes)), math.log(max(self.sizes))
        return max(x - hi, lo - x, 0.0)

    def predict(self, steps, lr, params: float | None = None, _z: np.ndarray | None = None) -> np.ndarray:
        steps_n = check_steps(steps, "predict")
        lr_T = dense_lr(steps_n, lr, "predict")
        th = self._theta(self.z if _z is None else _z, params)
        out = np.empty(len(steps_n))
        n_blocks = len(block_distances(int(steps_n[-1]) + 1))
        chunk = max(1, EVAL_CHUNK // max(n_blocks, 1))
        for i in range(0, len(steps_n), chunk):
            out[i : i + chunk] = Design(self.model, steps_n[i : i + chunk], lr_T).predict(th)
        return self._apply_size_prior(out, th, params)

    def predict_curve(self, curve: Curve) -> np.ndarray:
        return self.predict(curve.step, curve.lr_per_step, params=curve.params)

    def band(self, steps, lr, params: float | None = None, level: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) around predict(), half-widths added in quadrature: the training residuals' relative
        scatter and an extrapolation term extrap_rel x log(S1(t) / s1_max) beyond the largest LR area
        of the training curves (extrap_rel backtested on the curves themselves: fit on each curve's
        first half of LR area, error on the second half), both scaled by the leave-one-curve-out
        calibration factor `calib`, at normal quantiles; and, at a size outside the training sizes,
        the size term. Where the fit's own size backtest measured it (several sizes), the size term
        is per stretch of the run (steps are taken to run to the run's end): e-folds of N beyond the
        fitted sizes x the split-conformal quantile of the held-out curves' |mean relative error| per
        e-fold in that stretch (analysis.curves.sizeband); the bootstrap spread and the LR-area term,
        which those held-out refits already carry (each held-out size ran its own schedule), are then
        left out. Otherwise (one size: the prior SIZE_PRIOR_SD; an old
        fit without stretch scores: size_sd at Student's t quantile for the sizes it held out) the
        size sd per e-fold of N and the bootstrap refits' spread join at normal quantiles."""
        pred = self.predict(steps, lr, params)
        zq = float(norm.ppf(0.5 + level / 2))
        scores, rho = self.stretch_scores, self.size_efolds(params)
        size_half = 0.0
        if scores and rho > 0:
            # the held-out larger sizes ran under their own (longer) schedules: their residuals carry
            # the extrapolation in LR area too, so only the per-step scatter joins them
            var = (self.resid_rel_std * pred) ** 2 * self.calib**2
            size_half = size_halfwidth(check_steps(steps, "band"), pred, rho, scores, level)
        else:
            var = self._model_var(steps, lr, params, pred) * self.calib**2
            var = var + self._size_var(params, pred) * self._size_t(level)**2
        if self.boot_z is not None and len(self.boot_z) >= 2 and not (scores and rho > 0):
            draws = np.stack([self.predict(steps, lr, params, _z=zb) for zb in self.boot_z])
            var = var + draws.var(0, ddof=1)
        half = np.sqrt(zq**2 * var + size_half**2)
        return pred - half, pred + half

    @property
    def stretch_scores(self) -> list | None:
        """The size backtest's held-out scores per stretch (J x B); None where they come from fewer than
        MIN_HELD_OUT held-out sizes (a quantile of one size's errors is no quantile: the band is then
        the bootstrap, LR-area and size_sd one)."""
        rows = [r for r in self.size_backtest.get("curves", []) if r.get("stretch_scores")]
        if len({r.get("size") for r in rows}) < sizeband.MIN_HELD_OUT:
            return None
        return [r["stretch_scores"] for r in rows]

    def _model_var(self, steps, lr, params, pred: np.ndarray) -> np.ndarray:
        var = (self.resid_rel_std * pred) ** 2
        if self.extrap_rel > 0 and self.s1_max:
            steps_n = check_steps(steps, "band")
            s1_n = np.cumsum(dense_lr(steps_n, lr, "band"))[steps_n]
            rho_n = np.maximum(np.log(np.maximum(s1_n, 1e-300) / self.s1_max), 0.0)
            var = var + (self.extrap_rel * rho_n * pred) ** 2
        return var

    def _size_t(self, level: float) -> float:
        """A measured size term rests on few held-out sizes: its half-width takes Student's t quantile
        with that many degrees of freedom in place of the normal one (1 for the prior)."""
        dof = int(self.size_backtest.get("sizes_held_out", 0) or 0) if self.size_sd is not None else 0
        if dof < 1:
            return 1.0
        return float(student_t.ppf(0.5 + level / 2, dof) / norm.ppf(0.5 + level / 2))

    @property
    def size_term(self) -> float:
        """The size term's relative sd per e-fold of N: measured (size_sd) where the fit has several
        sizes and backtested them, else the prior SIZE_PRIOR_SD."""
        return SIZE_PRIOR_SD if self.size_sd is None else self.size_sd

    def _size_var(self, params, pred: np.ndarray) -> np.ndarray:
        scale = self.curve_params()["L0"] if self.law_kind == "none" and self._scales_floor else pred
        return (self.size_term * self.size_efolds(params) * scale) ** 2

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
            "floor_free": self.floor_free,
            "size_law_kind": self.size_law,
            "calib": self.calib,
            "calibration": self.calibration,
            "converged": self.converged,
            "warnings": list(self.warnings),
            "size_sd": self.size_sd,
            "size_backtest": self.size_backtest,
            "band_method": ("normal quantiles of: (relative residual scatter and extrapolation in LR area, backtested "
                            "per curve) x calib (leave-one-curve-out), "
                            + (f"{self.size_sd:.4g} relative per e-fold of N outside the fitted sizes (the fit's own "
                               "size backtest: each size from the smaller ones)" if self.size_sd is not None else
                               f"{SIZE_PRIOR_SD} relative per e-fold of N outside the fitted size (the published "
                               "laws' disagreement: one size measures no size dependence)")
                            + ", and the bootstrap refits' variance, in quadrature"),
        }
        if self.law_kind == "none":
            whole = f"the whole curve x (N/N_fit)^-{KAPLAN_ALPHA_N} (Kaplan et al. 2020)"
            d["size_prior"] = (
                (f"one training size: another size N gets L0(N) = L0 (N/N_fit)^-{KAPLAN_ALPHA_N}, Kaplan et al. "
                 "(2020)'s L(N) for the converged loss, the data term unchanged (Chinchilla's additive form)"
                 if self.floor_free else
                 f"one training size: L0 sits on a bound of its range (not measured), so another size N gets {whole}")
                if self.size_prior == "kaplan-floor" else
                f"one training size: another size N gets {whole}"
                if self.size_prior == "kaplan" else
                f"one training size: another size N gets L0(N) = E + (L0 - E) (N/N_fit)^-{CHINCHILLA_ALPHA} with "
                f"E/L0 from Chinchilla's L(N) = {CHINCHILLA_E} + {CHINCHILLA_A}/N^{CHINCHILLA_ALPHA} at N_fit; "
                "the other parameters are kept"
            )
        else:
            d["size_law"] = (
                ("L0(N) = E + a (N/N_ref)^-p, log A, log alpha, log B linear in log(N/N_ref) (slopes s_*), "
                 if self.size_law == "slopes" else "additive: L0(N) = E + a (N/N_ref)^-p, the other parameters shared, ")
                + f"N_ref = {math.exp(self.log_nref):.4g}"
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
                floor_free=bool(d.get("floor_free", True)),
                size_law=str(d.get("size_law_kind", "slopes")),
                sizes=list(d.get("sizes") or []),
                calib=float(d.get("calib", 1.0)),
                calibration=dict(d.get("calibration") or {}),
                size_sd=None if d.get("size_sd") is None else float(d["size_sd"]),
                size_backtest=dict(d.get("size_backtest") or {}),
                converged=bool(d.get("converged", True)),
                warnings=list(d.get("warnings") or []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CurveError(f"not a curve fit: {e}") from None
