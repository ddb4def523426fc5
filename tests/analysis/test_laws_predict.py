"""analysis.laws.predict (the body of `ladder law predict`): a saved fit read back, predicted at new
points and scored; bad files and points are PredictErrors (one line in the CLI), not tracebacks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from analysis.laws.fit import fit_envelope
from analysis.laws.predict import PredictError, predict_saved_fit, read_saved_fit
from core.errors import InputError


@pytest.fixture(scope="module")
def envelope_doc():
    C = np.logspace(18, 22, 12)
    return fit_envelope(C, 1.7 + 2e3 * C ** -0.15, n_bootstrap=20).to_dict()


def test_a_saved_envelope_predicts_its_own_law_and_scores_against_measured_losses(tmp_path, envelope_doc):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(envelope_doc))
    doc, fit = read_saved_fit(path)
    C = np.array([1e23, 1e24])
    truth = 1.7 + 2e3 * C ** -0.15
    cols, out = predict_saved_fit(doc, fit, path, C=C, actual=truth)
    assert cols == ["C"] and out["fit"] == str(path) and [p["C"] for p in out["predictions"]] == list(C)
    assert all(p["lo"] <= p["loss"] <= p["hi"] for p in out["predictions"])
    assert out["score"]["n"] == 2 and out["score"]["max_abs_rel_error"] < 0.01


@pytest.mark.parametrize("text,match", [("{bad", "not valid JSON"), ('{"fits": []}', "several fits"),
                                        ('{"kind": "nope"}', "not a law fit")])
def test_a_file_that_is_not_one_saved_fit_is_a_predict_error_naming_it(tmp_path, text, match):
    path = tmp_path / "fit.json"
    path.write_text(text)
    with pytest.raises(PredictError, match=match) as err:
        read_saved_fit(path)
    assert isinstance(err.value, InputError)


def test_points_that_do_not_fit_the_laws_kind_are_predict_errors(tmp_path, envelope_doc):
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(envelope_doc))
    with pytest.raises(PredictError, match="--level"):
        read_saved_fit(path, level=2.0)
    doc, fit = read_saved_fit(path)
    with pytest.raises(PredictError, match="--flops C alone"):
        predict_saved_fit(doc, fit, path, N=np.array([1e9]), C=np.array([1e21]))
