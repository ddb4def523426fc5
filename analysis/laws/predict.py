"""A saved law fit's predictions at held-out points, with prediction intervals, and their score against
measured losses where those are given (`ladder law predict`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from analysis.laws.fitted import EnvelopeFit, FitError, LawFit, MoELawFit, _PowerFit
from core.safeload import InputLimitError, load_file

__all__ = ["KINDS", "PredictError", "predict_saved_fit", "read_saved_fit", "score"]

KINDS = ("law", "envelope", "moe")  # the "kind" of a fit's JSON (`ladder law fit/envelope --json`)
_CLASSES: dict[str, type[_PowerFit]] = {"law": LawFit, "envelope": EnvelopeFit, "moe": MoELawFit}


class PredictError(FitError):
    """A saved fit, or points, that a prediction cannot use; the message says which (the flag or the file)."""


def read_saved_fit(fit_file: Path, level: float | None = None) -> tuple[dict, _PowerFit]:
    """(the JSON document, the fit) of a fit saved by `ladder law fit/envelope --json`; a PredictError
    naming the file for one that is not valid JSON, holds several fits or no known kind, or cannot be
    rebuilt, and for a `level` (the interval coverage asked for; None: the fit's) outside (0, 1)."""
    try:
        doc = load_file(fit_file, "json")
    except InputLimitError as e:
        raise PredictError(str(e)) from None
    except json.JSONDecodeError as e:
        raise PredictError(f"{fit_file}: not valid JSON ({e})") from None
    if isinstance(doc, dict) and "fits" in doc:
        raise PredictError(f"{fit_file}: holds several fits; save one (a single --loss-col) to predict from it")
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in KINDS:
        raise PredictError(f"{fit_file}: not a law fit (no 'kind' of {', '.join(KINDS)}; refit with this version)")
    if level is not None and not 0 < level < 1:
        raise PredictError(f"--level must be in (0, 1), got {level}")
    try:
        return doc, _CLASSES[kind].from_dict(doc)
    except FitError as e:
        raise PredictError(f"{fit_file}: {e}") from None


def _broadcast(fn, *args):
    """fn(*args) for numpy's np.broadcast_arrays or np.broadcast_to; a PredictError where the shapes do not broadcast."""
    try:
        return fn(*args)
    except ValueError as e:  # numpy's word for shapes that do not broadcast
        raise PredictError(f"cannot broadcast the given values: {e}") from None


def _points(kind: str, fit: _PowerFit, N, Nt, D, C, level: float | None) -> tuple[dict[str, np.ndarray], dict]:
    """(the points' columns by name, the fit's prediction there) for a fit of this kind."""
    if kind == "envelope":
        if C is None or any(x is not None for x in (N, Nt, D)):
            raise PredictError("an envelope fit predicts from --flops C alone")
        return {"C": C}, fit.predict(C, level=level)
    if N is None or (D is None) == (C is None):
        raise PredictError("give --params N and exactly one of --tokens D or --flops C")
    N_b, second = _broadcast(np.broadcast_arrays, N, D if D is not None else C)
    D_b = second if D is not None else second / (6.0 * N_b)
    rows = {"N": N_b, "D": D_b}
    if kind != "moe":
        return rows, fit.predict(N_b, D_b, level=level)
    if Nt is None:
        raise PredictError("the MoE law needs --total-params too")
    rows["N_total"] = _broadcast(np.broadcast_to, Nt, N_b.shape)
    return rows, fit.predict(N_b, rows["N_total"], D_b, level=level)


def score(predictions: list[dict], actual: np.ndarray) -> dict:
    """Each prediction against its measured loss (its "actual", "error", "rel_error" and "inside" set
    in place), and the summary: mean and worst relative error, how many measured losses fall inside
    their interval."""
    rel = []
    inside = 0
    for r, a in zip(predictions, actual):
        r["actual"] = float(a)
        r["error"] = r["loss"] - float(a)
        r["rel_error"] = r["error"] / float(a)
        r["inside"] = bool(r["lo"] <= a <= r["hi"])
        rel.append(abs(r["rel_error"]))
        inside += r["inside"]
    return {"n": len(rel), "mean_abs_rel_error": float(np.mean(rel)), "max_abs_rel_error": float(np.max(rel)),
            "inside": inside, "coverage": inside / len(rel)}


def predict_saved_fit(doc: dict, fit: _PowerFit, fit_file: Path, N: np.ndarray | None = None,
                      Nt: np.ndarray | None = None, D: np.ndarray | None = None, C: np.ndarray | None = None,
                      level: float | None = None, actual: np.ndarray | None = None) -> tuple[list[str], dict[str, Any]]:
    """A saved fit (read_saved_fit's doc and fit, from fit_file) at held-out points: an envelope fit at
    FLOPs C alone; a law at parameters N and tokens D, or FLOPs C (D = C / 6N), broadcast against each
    other; the MoE law with total parameters Nt too. level: the intervals' coverage (None: the fit's).
    With actual (the measured loss at each point), each prediction is scored (score).

    Returns (the points' column names, in the order they print, and the document `ladder law predict
    --json` prints: fit, law, level, interval, warnings, predictions, and score with actual). A
    PredictError names the points that do not fit the law's kind."""
    rows, p = _points(doc["kind"], fit, N, Nt, D, C, level)
    n = len(np.atleast_1d(p["loss"]))
    out: dict[str, Any] = {
        "fit": str(fit_file), "law": doc.get("law"), "level": level or fit.level, "interval": doc.get("interval"),
        "warnings": list(fit.warnings) + ([] if fit.converged else ["the saved fit did not converge"]),
        "predictions": [{**{k: float(np.atleast_1d(v)[i]) for k, v in rows.items()},
                         "loss": float(np.atleast_1d(p["loss"])[i]), "lo": float(np.atleast_1d(p["lo"])[i]),
                         "hi": float(np.atleast_1d(p["hi"])[i])} for i in range(n)]}
    if actual is not None:
        out["score"] = score(out["predictions"], actual)
    return list(rows), out
