"""`ladder law predict --csv` scoring a fit on measured losses, and `--where` beyond equality."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ladder.law_table import apply_where, parse_where
from ladder.errors import LadderError
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]
CHINCHILLA = REPO / "tests" / "data" / "chinchilla" / "svg_extracted_data.csv"


def law(*args) -> subprocess.CompletedProcess:
    return cli_fork.ladder("law", *args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


FRAME = pd.DataFrame({"n": [1, 2, 3, 4, 5], "set": ["a", "b", "a", "c", "b"]})


@pytest.mark.parametrize("cond,kept", [
    ("n<3", [1, 2]), ("n<=3", [1, 2, 3]), ("n>3", [4, 5]), ("n>=4", [4, 5]), ("n!=2", [1, 3, 4, 5]),
    ("set=a,c", [1, 3, 4]), ("set!=a,b", [4]), ("n=2,5", [2, 5]), ("set==b", [2, 5]),
])
def test_where_selects_rows_by_comparison_and_by_list(cond, kept):
    assert list(apply_where(FRAME, Path("f.csv"), parse_where([cond]))["n"]) == kept


@pytest.mark.parametrize("cond", ["n<abc", "<3", "n"])
def test_a_where_that_cannot_be_read_is_one_clear_error(cond):
    with pytest.raises(LadderError, match="--where"):
        parse_where([cond])


def test_law_predict_scores_a_chinchilla_fit_on_the_larger_models_it_never_saw(tmp_path):
    fit = law("fit", CHINCHILLA, "--params-col", "Model Size", "--flops-col", "Training FLOP", "--loss-col", "loss",
              "--where", "Model Size<1e9", "--where", "loss<5", "--bootstrap", "20", "--no-backtest", "--json")
    assert fit.returncode == 0, fit.stderr
    doc = json.loads(fit.stdout)
    assert doc["data"]["where"] == {"Model Size": "<1e9", "loss": "<5"}
    (tmp_path / "fit.json").write_text(fit.stdout)
    out = law("predict", tmp_path / "fit.json", "--csv", CHINCHILLA, "--params-col", "Model Size", "--flops-col",
              "Training FLOP", "--actual-col", "loss", "--where", "Model Size>=1e9", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    held = pd.read_csv(CHINCHILLA).query("`Model Size` >= 1e9")
    sc = rep["score"]
    assert sc["n"] == len(held) == len(rep["predictions"])
    errs = [abs(p["loss"] - a) / a for p, a in zip(rep["predictions"], held["loss"])]
    assert sc["mean_abs_rel_error"] == pytest.approx(np.mean(errs)) and sc["max_abs_rel_error"] == pytest.approx(max(errs))
    assert sc["inside"] == sum(p["lo"] <= p["actual"] <= p["hi"] for p in rep["predictions"])
    assert sc["mean_abs_rel_error"] < 0.05  # Chinchilla's law extrapolates well past 1B


def test_law_predict_refuses_values_and_a_csv_together():
    out = law("predict", CHINCHILLA, "--csv", CHINCHILLA, "--params", "1e9", "--tokens", "1e10")
    assert out.returncode == 2 and "not both" in out.stderr and len(out.stderr.strip().splitlines()) == 1
