"""`ladder forecast --from-csv`: another project's ladder (specs and exported curves) forecast like ours.
The ladder is the committed H200 one (docs/results/h200_ladder), its curves exported to CSV files."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from analysis.runs.metrics import read_metrics_frame
from core.rundir import iter_run_dirs
from ladder.errors import LadderError
from ladder.ladder_csv import read_ladder_csv
from tests import cli_fork
from tests.support import FIT_RTOL

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(dir, hero spec path, run dirs): each rung's curve as a CSV export beside a ladder CSV, and a
    second ladder CSV of train-only exports with the final held-out losses in a column."""
    from core.spec import load_spec

    root = tmp_path_factory.mktemp("h200")
    with tarfile.open(REPO / "docs" / "results" / "h200_ladder" / "h200_ladder.tar.gz") as tar:
        tar.extractall(root, filter="data")
    runs = list(iter_run_dirs(root))
    rows, hero = [], None
    for rd in runs:
        name = rd.path.name.rsplit("-", 1)[0]
        if name.startswith("hero"):  # the experiment's hero (seed 0), whose forecast is committed
            hero = rd.spec_path if load_spec(rd.spec_path).seed == 0 else hero
            continue
        df = read_metrics_frame(rd.metrics_path)
        # exported as a stack's logger or a W&B history export gives a curve: every 20th step, the
        # evals and the last step (the trajectory fit then reads ~110 points a rung, not 2,200)
        last = df["step"] == df["step"].max()
        sampled = df[(df["step"] % 20 == 0) | df["eval_loss"].notna() | last]
        sampled[["step", "loss", "eval_loss", "lr", "grad_norm"]].to_csv(root / f"{name}.csv", index=False)
        train_only = df[(df["step"] % 20 == 0) | last]
        train_only[["step", "loss", "lr", "grad_norm"]].to_csv(root / f"{name}-train.csv", index=False)
        final = float(df["eval_loss"].dropna().iloc[-1])
        rows.append({"name": name, "spec": str(rd.spec_path.relative_to(root)), "curve": f"{name}.csv",
                     "train_curve": f"{name}-train.csv", "final": final})
    table = pd.DataFrame(rows)
    table[["name", "spec", "curve"]].to_csv(root / "ladder.csv", index=False)
    table.rename(columns={"curve": "_", "train_curve": "curve", "final": "final_loss"})[
        ["name", "spec", "curve", "final_loss"]].to_csv(root / "ladder_finals.csv", index=False)
    return root, hero, runs


def forecast_cli(*args) -> subprocess.CompletedProcess:
    return cli_fork.ladder("forecast", *args, "--json", cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                           timeout=600)


@pytest.mark.slow
def test_a_ladder_csv_of_exported_curves_forecasts_the_hero_as_the_ledger_does(exported):
    """The ledger's forecast is the committed straddle_forecast.json.gz: `ladder forecast` on these runs'
    ledger reproduces it (tests/analysis/test_h200_ladder.py), so it is not computed again here."""
    root, hero, runs = exported
    out = forecast_cli("--from-csv", root / "ladder.csv", "--hero", hero, "--out", root / "fc")
    assert out.returncode == 0, out.stderr
    fc = json.loads(out.stdout)
    want = json.loads(gzip.open(REPO / "docs" / "results" / "h200_ladder" / "straddle_forecast.json.gz").read())
    assert fc["hero"]["final_loss"]["mean"] == pytest.approx(want["hero"]["final_loss"]["mean"], rel=FIT_RTOL)
    assert fc["backtest"]["held_out"] == want["backtest"]["held_out"]
    assert fc["trajectory"] and len(fc["trajectory"]["step"]) > 10 and (root / "fc" / "forecast.json").exists()


@pytest.mark.slow
def test_final_losses_given_in_the_csv_stand_for_curves_without_an_eval(exported):
    """Curves of the train loss only, sampled every 20th step, with each rung's final eval loss in
    the ladder CSV: the same final-loss forecast as from the curves with their evals."""
    root, hero, _ = exported
    with_eval = json.loads((root / "fc" / "forecast.json").read_text()) if (root / "fc" / "forecast.json").exists() \
        else json.loads(forecast_cli("--from-csv", root / "ladder.csv", "--hero", hero, "--out", root / "fc").stdout)
    out = forecast_cli("--from-csv", root / "ladder_finals.csv", "--hero", hero, "--out", root / "fc2")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["hero"]["final_loss"]["mean"] == pytest.approx(with_eval["hero"]["final_loss"]["mean"], rel=1e-9)


def test_a_curve_without_an_eval_and_no_final_loss_is_named(exported, tmp_path):
    root, _, _ = exported
    table = pd.read_csv(root / "ladder_finals.csv").drop(columns="final_loss")
    table["spec"] = [str(root / s) for s in table["spec"]]
    table["curve"] = [str(root / c) for c in table["curve"]]
    table.to_csv(tmp_path / "l.csv", index=False)
    with pytest.raises(LadderError, match="row 1: the curve .* has no eval_loss; give .* final_loss"):
        read_ladder_csv(tmp_path / "l.csv")


def test_a_ladder_csv_without_its_columns_is_one_clear_error(tmp_path):
    (tmp_path / "l.csv").write_text("rung,loss\nd1,3.0\n")
    with pytest.raises(LadderError, match="missing column.*'name'.*'spec'.*'curve'"):
        read_ladder_csv(tmp_path / "l.csv")
