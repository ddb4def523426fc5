"""Replicate families, the ladder's measurement noise and the one-yardstick rule, on the committed H200
ladder's real runs (docs/results/h200_ladder) and replicates made from its specs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.forecast.hero import RungRun, backtest, final_law, ladder_points
from analysis.runs.metrics import read_metrics_frame
from analysis.runs.replicates import YardstickError, check_yardstick, family_key, group, noise
from core.rundir import iter_run_dirs
from core.spec import load_spec
from ladder.experiment import replicate

ROOT = Path(__file__).resolve().parents[2]
TAR = ROOT / "docs" / "results" / "h200_ladder" / "h200_ladder.tar.gz"


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    """The committed H200 ladder unpacked as a ledger root (runs/proxy_h200/<name>-<id>/)."""
    root = tmp_path_factory.mktemp("h200")
    with tarfile.open(TAR) as tar:
        tar.extractall(root / "runs", filter="data")
    runs = [RungRun(load_spec(rd.spec_path), rd.path, read_metrics_frame(rd.metrics_path))
            for rd in iter_run_dirs(root / "runs")]
    return root, {r.spec.name: r for r in runs}


def _seed(run: RungRun, seed: int, scale: float) -> RungRun:
    """A replicate of `run` at another seed whose final eval loss is `scale` times the run's."""
    m = run.metrics.copy()
    m["eval_loss"] = m["eval_loss"] * scale
    return RungRun(replicate(run.spec, seed), run.run_dir, m)


def test_runs_that_differ_only_in_their_seed_are_one_family_at_their_mean_loss(h200):
    _, runs = h200
    d192 = runs["d192"]
    fams = group([d192, _seed(d192, 1, 1.02), runs["d256"]])
    assert [f.names for f in fams] == [["d192", "d192-seed1"], ["d256"]]
    assert fams[0].final_loss == pytest.approx(d192.final_loss * 1.01)
    assert family_key(d192.spec) == family_key(replicate(d192.spec, 3)) != family_key(runs["d256"].spec)


def test_the_seed_spread_is_pooled_over_the_families_that_have_replicates(h200):
    _, runs = h200
    a, b = runs["d192"], runs["d256"]
    fams = group([a, _seed(a, 1, 1.02), b, _seed(b, 1, 0.99), _seed(b, 2, 1.01), runs["d320"]])
    nz = noise(fams)
    ya = np.log([1.0, 1.02])
    yb = np.log([1.0, 0.99, 1.01])
    want = (((ya - ya.mean()) ** 2).sum() + ((yb - yb.mean()) ** 2).sum()) / (1 + 2)
    assert nz.seed_dof == 3 and nz.seed_var == pytest.approx(want)
    # a family's mean carries the seed variance over its size (the unreplicated d320 the whole of it),
    # plus its eval set's own sampling variance, which replicates scored on the same windows do not shrink
    ev = {f.name: (f.eval_rel_se or 0.0) ** 2 for f in fams}
    assert nz.family_var["d256"] == pytest.approx(want / 3 + ev["d256"])
    assert nz.family_var["d320"] == pytest.approx(want + ev["d320"])


def test_a_ladder_without_replicates_says_its_noise_is_unmeasured(h200):
    _, runs = h200
    nz = noise(group([runs[n] for n in ("d192", "d256", "d320")]))
    assert nz.seed_var is None and any("no rung has a replicate" in w for w in nz.warnings)


def test_runs_scored_on_different_eval_sets_are_refused_in_one_line_naming_both():
    class R:
        def __init__(self, name):
            self.spec = type("S", (), {"name": name})()

    fps = {"d192": "aaaa1111", "d256": "aaaa1111", "d320": "bbbb2222"}
    with pytest.raises(YardstickError) as e:
        check_yardstick([R(n) for n in fps], fps)
    msg = str(e.value)
    assert "\n" not in msg and "aaaa1111" in msg and "bbbb2222" in msg and "d192" in msg and "d320" in msg
    assert check_yardstick([R(n) for n in ("d192", "d256")], {"d192": "aaaa1111", "d256": "aaaa1111"}) == "aaaa1111"


def test_a_run_without_a_fingerprint_beside_runs_with_one_is_another_yardstick():
    with pytest.raises(YardstickError, match="no eval_set fingerprint"):
        check_yardstick([], {"d192": "aaaa1111", "d256": "aaaa1111", "d320": None})


def test_the_backtest_holds_out_a_family_with_its_replicates(h200):
    _, runs = h200
    ladder = [runs[n] for n in ("d192", "d256", "d320", "d384")]
    rep = _seed(runs["d384"], 1, 1.03)
    bt = backtest(ladder + [rep])
    assert bt.members == ["d384", "d384-seed1"]
    assert bt.actual == pytest.approx(runs["d384"].final_loss * 1.015)
    # the prediction is the same as without the replicate: nothing of d384 was fitted
    assert bt.predicted == pytest.approx(backtest(ladder).predicted, rel=1e-9)


def test_the_law_fits_one_point_per_family(h200):
    _, runs = h200
    pts, nz = ladder_points([runs["d192"], _seed(runs["d192"], 1, 1.02), runs["d256"], runs["d320"]])
    assert [p.name for p in pts] == ["d192", "d256", "d320"] and pts[0].members == ("d192", "d192-seed1")
    assert nz.seed_dof == 1 and pts[0].var < pts[1].var


def test_a_ladder_too_short_for_its_backtest_says_so_and_keeps_the_term(h200):
    _, runs = h200
    law = final_law([runs[n] for n in ("d192", "d256", "d320")])
    iv = law.interval(runs["hero-d512"].flops)
    assert any("no backtest can run" in w for w in law.warnings)
    assert iv["sd"]["backtest"] > 0 and iv["lo"] < iv["mean"] < iv["hi"]


def test_forecast_refuses_rungs_scored_on_different_eval_sets(h200, tmp_path):
    root, runs = h200
    exp = tmp_path / "h200_exp.py"
    specs = {n: str(r.run_dir / "spec.yaml") for n, r in runs.items()}
    exp.write_text("from core.spec import load_spec\nfrom ladder.experiment import Experiment\n"
                   f"S = {specs!r}\n"
                   "EXPERIMENT = Experiment(name='proxy_h200', rungs=tuple(load_spec(S[n]) for n in "
                   "('d192', 'd256', 'd320', 'd384')), hero=load_spec(S['hero-d512']))\n")
    for name, fp in (("d192", "aaaa1111"), ("d256", "aaaa1111"), ("d320", "aaaa1111"), ("d384", "bbbb2222")):
        st = runs[name].run_dir / "status.json"
        data = json.loads(st.read_text())
        st.write_text(json.dumps({**data, "eval_set": {"fingerprint": fp, "seq_len": 1024, "sources": {}}}))
    try:
        out = subprocess.run([sys.executable, "-m", "ladder.cli", "forecast", str(exp), "--root", str(root),
                              "--no-tracking"], capture_output=True, text=True, cwd=ROOT)
    finally:
        for name in ("d192", "d256", "d320", "d384"):
            st = runs[name].run_dir / "status.json"
            data = json.loads(st.read_text())
            data.pop("eval_set")
            st.write_text(json.dumps(data))
    assert out.returncode == 2, out.stderr
    text = " ".join(out.stderr.split())
    assert "different eval sets" in text and "aaaa1111" in text and "bbbb2222" in text and "d384" in text
    assert "Traceback" not in out.stderr and not (root / "analysis" / "proxy_h200" / "forecast.json").exists()


def test_the_final_eval_record_gives_the_loss_and_its_standard_error(h200):
    _, runs = h200
    r = runs["d192"]
    m = r.metrics.copy()
    last = m["step"].idxmax()
    m["extra.eval_final"] = pd.Series([None] * len(m), dtype=object)
    m.loc[last, "extra.eval_final"] = True
    m["extra.eval_loss_se"] = np.nan
    m.loc[last, "extra.eval_loss_se"] = 0.004
    run = RungRun(r.spec, r.run_dir, m)
    assert run.final_loss == pytest.approx(float(m.loc[last, "eval_loss"])) and run.final_se == 0.004
    assert math.isclose(group([run])[0].eval_rel_se, 0.004 / run.final_loss)
