"""The live-run monitor on real loss curves (multipower), hand-written CSVs and synthetic runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.runs.metrics import MetricsError, read_metrics_frame
from analysis.monitor.watch import MonitorSettings, load_forecast, monitor, olmo_spike_score
from ladder.presets import micro_spec

from tests import cli_fork
from tests.refdata import MULTIPOWER
LADDER = [sys.executable, "-m", "ladder.cli"]


def kinds(report) -> set[str]:
    return {f.kind for f in report.flags}


def flag(report, kind):
    return next(f for f in report.flags if f.kind == kind)


def run_cli(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return cli_fork.ladder(*args, cwd=cwd, env=env, timeout=600)


def forecast_file(path: Path, steps, loss, rel_halfwidth: float, gn=None) -> Path:
    steps = np.asarray(steps, dtype=float)
    loss = np.asarray(loss, dtype=float)
    doc = {"trajectory": {"step": steps.tolist(), "loss": loss.tolist(),
                          "lo": (loss * (1 - rel_halfwidth)).tolist(), "hi": (loss * (1 + rel_halfwidth)).tolist()},
           "hero": {"spec_id": "x", "final_loss": {"mean": float(loss[-1]), "lo": 0, "hi": 9, "level": 0.9}}}
    if gn is not None:
        doc["grad_norm"] = {"step": steps.tolist(), "mean": list(gn[0]), "lo": list(gn[1]), "hi": list(gn[2])}
    path.write_text(json.dumps(doc))
    return path


# ---- real curves ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["25M", "100M"])
def test_healthy_real_curves_raise_no_flag(size):
    for f in sorted((MULTIPOWER / size).glob("*.csv")):
        report = monitor(read_metrics_frame(f))
        assert report.flags == [], (f.name, [(x.kind, x.evidence["text"]) for x in report.flags])


def test_spike_injected_into_a_real_curve_is_flagged_at_its_step():
    df = read_metrics_frame(MULTIPOWER / "25M" / "cosine_24000.csv")
    i = 120
    df.loc[i, "loss"] += 0.15  # ~4% of the loss there
    report = monitor(df)
    f = flag(report, "loss_spike")
    assert f.first_step == int(df["step"][i])
    assert f.evidence["n_spikes"] == 1


def test_real_wsd_decay_leaves_a_constant_lr_forecast_band_below_when_the_decay_starts(tmp_path):
    """Forecast band = the constant-LR curve +-0.5%; the WSD run shares it until its decay at
    step 20,000, then drops below: flagged as below the band from the decay; once two widths of
    this narrow band beyond it, a warning even without a calibration."""
    const = read_metrics_frame(MULTIPOWER / "100M" / "constant_24000.csv")
    fc = load_forecast(forecast_file(tmp_path / "f.json", const["step"], const["loss"], 0.005))
    wsd = read_metrics_frame(MULTIPOWER / "100M" / "wsd_20000_24000.csv")
    report = monitor(wsd, forecast=fc)
    f = flag(report, "loss_below_band")
    assert f.severity == "warning"
    assert 20000 <= f.evidence["onset_step"] <= 21000 and f.first_step < 24000
    assert "loss_above_band" not in kinds(report)


def test_loss_above_band_needs_k_consecutive_points(tmp_path):
    steps = np.arange(0, 200)
    base = 2 + 3 * np.exp(-steps / 50)
    fc = load_forecast(forecast_file(tmp_path / "f.json", steps, base, 0.01))
    loss = base.copy()
    loss[100:102] *= 1.03  # two points out: not enough for k=3
    assert "loss_above_band" not in kinds(monitor(pd.DataFrame({"step": steps, "loss": loss}), forecast=fc))
    loss[150:160] *= 1.03
    f = flag(monitor(pd.DataFrame({"step": steps, "loss": loss}), forecast=fc), "loss_above_band")
    # the forecast's band alone is not calibrated on healthy runs: inside one more band width, info
    assert (f.evidence["onset_step"], f.first_step, f.severity) == (150, 152, "info")
    f5 = flag(monitor(pd.DataFrame({"step": steps, "loss": loss}), forecast=fc, settings=MonitorSettings(band_k=5)),
              "loss_above_band")
    assert f5.first_step == 154


def test_an_uncalibrated_gross_departure_is_a_warning_that_states_its_false_alarm_rate(tmp_path):
    steps = np.arange(0, 200)
    base = 2 + 3 * np.exp(-steps / 50)
    fc = load_forecast(forecast_file(tmp_path / "f.json", steps, base, 0.01))
    loss = base.copy()
    loss[150:160] *= 1.10  # far beyond the band's 1% half width: beyond it by more than one band width
    f = flag(monitor(pd.DataFrame({"step": steps, "loss": loss}), forecast=fc), "loss_above_band")
    assert f.severity == "warning" and f.first_step == 152
    # one band width beyond a 90% band: 1.645 * 3 = 4.93 sigma, one side
    assert "uncalibrated" in f.evidence["text"] and "probability 4.0e-07" in f.evidence["text"]
    assert "ladder calibrate" in f.evidence["text"]


# ---- synthetic runs -------------------------------------------------------------------------


def synthetic(n=300, seed=0, **cols):
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    df = pd.DataFrame({"step": steps, "tokens": (steps + 1) * 512.0,
                       "loss": 2.5 + 3 * np.exp(-steps / 40) + 0.01 * rng.standard_normal(n),
                       "grad_norm": 0.8 + 0.02 * rng.standard_normal(n)})
    for k, v in cols.items():
        df[k] = v
    return df


def test_a_healthy_synthetic_run_raises_no_flag():
    assert monitor(synthetic()).flags == []


def test_a_batch_read_twice_is_critical_at_the_step_that_reads_it_again():
    hashes = np.arange(300, dtype=np.float64) * 7919 + 11
    assert "repeated_batch" not in kinds(monitor(synthetic(**{"extra.batch_hash": hashes})))
    hashes[250:260] = hashes[100:110]  # batches of 150 steps earlier read again
    f = flag(monitor(synthetic(**{"extra.batch_hash": hashes}), micro_spec()), "repeated_batch")
    assert (f.severity, f.first_step, f.evidence["repeats_step"], f.evidence["repeated"]) == ("critical", 250, 100, 10)


def test_a_repeated_batch_is_info_where_the_spec_allows_more_than_one_epoch():
    hashes = np.zeros(300)
    f = flag(monitor(synthetic(**{"extra.batch_hash": hashes}), micro_spec(**{"data.max_epochs": 2.0})),
             "repeated_batch")
    assert (f.severity, f.first_step) == ("info", 1)


def test_nan_loss_is_critical_at_its_step():
    df = synthetic()
    df.loc[200:, "loss"] = np.nan
    f = flag(monitor(df), "non_finite")
    assert (f.severity, f.first_step) == ("critical", 200)
    assert monitor(df).critical


def test_divergence_is_a_critical_loss_jump():
    df = synthetic()
    df.loc[150:, "loss"] = np.linspace(2.6, 5.5, 150)  # +0.02 per step from ~2.57
    f = flag(monitor(df), "loss_jump")
    assert f.severity == "critical"
    assert 150 <= f.first_step <= 166  # 10% above the minimum: ~13 steps of climb, plus the median's lag
    assert f.evidence["critical_step"] <= 190


def test_grad_norm_thresholds_warn_at_2_and_are_critical_at_4():
    df = synthetic()
    df.loc[100:, "grad_norm"] = 2.5
    f = flag(monitor(df), "grad_norm_high")
    assert (f.severity, f.first_step) == ("warning", 101)  # median of 3: two of three points over
    df.loc[200:, "grad_norm"] = 5.0
    f = flag(monitor(df), "grad_norm_high")
    assert (f.severity, f.first_step, f.evidence["critical_step"]) == ("critical", 101, 201)


def test_grad_norm_is_not_judged_during_warmup():
    df = synthetic()
    df.loc[:9, "grad_norm"] = 6.0
    spec = micro_spec(**{"data.total_tokens": 512 * 300, "schedule.warmup_steps": 15})
    assert "grad_norm_high" not in kinds(monitor(df, spec))
    assert "grad_norm_high" in kinds(monitor(df))


def test_grad_norm_growth_is_judged_against_the_forecast_envelope(tmp_path):
    df = synthetic()
    grow = np.exp(np.linspace(0, math.log(5.0), 300))  # 2.2x over the trailing half
    df["grad_norm"] = 0.5 * grow * (1 + 0.02 * np.random.default_rng(1).standard_normal(300))
    steps = df["step"].to_numpy()
    assert "grad_norm_growth" in kinds(monitor(df))  # no envelope: grad norm should stay flat
    same = 0.5 * grow
    fc = load_forecast(forecast_file(tmp_path / "f.json", steps, df["loss"], 0.5, gn=(same, same * 0.7, same * 1.3)))
    assert "grad_norm_growth" not in kinds(monitor(df, forecast=fc))  # the envelope grows the same way
    flat = np.full(300, 0.5)
    fc = load_forecast(forecast_file(tmp_path / "g.json", steps, df["loss"], 0.5, gn=(flat, flat * 0.7, flat * 1.3)))
    r = monitor(df, forecast=fc)
    assert {"grad_norm_growth", "grad_norm_above_envelope"} <= kinds(r)


def test_grad_norm_spike_is_flagged_and_scored_as_olmo_2_does():
    df = synthetic(n=2000)
    df.loc[1500, "grad_norm"] = 3.0
    r = monitor(df)
    f = flag(r, "grad_norm_spike")
    assert f.first_step == 1500
    # one spike point in 2000 (the first points lack history and are not scored)
    assert f.evidence["spike_score"] == pytest.approx(1 / 1998, rel=0.01)
    assert olmo_spike_score(np.ones(50) + 1e-3 * np.arange(50)) == 0.0


def test_token_drops_over_the_budget_are_flagged():
    df = synthetic(drop_frac_send=0.02, drop_frac_recv=0.02)
    assert "token_drops" not in kinds(monitor(df))
    df.loc[120:, "drop_frac_recv"] = 0.06  # 8% in all
    f = flag(monitor(df), "token_drops")
    assert (f.severity, f.first_step) == ("warning", 120)
    assert f.evidence["drop_frac"] == pytest.approx(0.08)
    f = flag(monitor(df, settings=MonitorSettings(drop_crit=0.075)), "token_drops")
    assert f.severity == "critical"


def test_router_entropy_collapse_is_flagged_against_its_early_value_and_log_top_k():
    spec = micro_spec(**{"data.total_tokens": 512 * 300})  # top_k 2, 8 experts
    ent = np.full(300, math.log(8))
    df = synthetic(router_entropy=ent)
    assert "router_entropy_collapse" not in kinds(monitor(df, spec))
    ent[200:] = 0.3  # below 0.5 x log(2) = 0.35
    f = flag(monitor(synthetic(router_entropy=ent), spec), "router_entropy_collapse")
    assert f.first_step == 201  # rolling median of 3
    assert f.evidence["floor_from"] == "early value"  # 0.25 x log 8 = 0.52 > 0.35


def test_low_throughput_projects_the_finish_date():
    spec = micro_spec(**{"data.total_tokens": 512 * 1000})
    df = synthetic(tokens_per_s=100.0)
    df["time"] = 1.8e9 + df["step"] * 5.12  # 100 tokens/s in wall time too
    r = monitor(df, spec, plan_tokens_per_s=1000.0)
    f = flag(r, "throughput_low")
    assert f.evidence["ratio"] == pytest.approx(0.1)
    # 700 steps x 512 tokens left at 100 tokens/s after the last record's time
    t_last = 1.8e9 + 299 * 5.12
    want = pd.Timestamp(t_last + 700 * 512 / 100.0, unit="s", tz="UTC").strftime("%Y-%m-%dT%H:%M:%SZ")
    assert f.evidence["projected_finish"] == want
    assert "throughput_low" not in kinds(monitor(df, spec, plan_tokens_per_s=105.0))


def test_settings_come_from_yaml_then_overrides_and_bad_ones_are_named(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("band_k: 5\ngrad_norm_warn: 1.5\n")
    s = MonitorSettings.load(p, {"grad_norm_warn": "1.2"})
    assert (s.band_k, s.grad_norm_warn, s.drop_budget) == (5, 1.2, 0.07)
    with pytest.raises(ValueError, match="no_such_threshold"):
        MonitorSettings.load(None, {"no_such_threshold": 1})
    with pytest.raises(ValueError, match="band_k"):
        MonitorSettings.load(None, {"band_k": 0})


# ---- reading metrics ------------------------------------------------------------------------


def test_a_hand_written_csv_with_other_column_names_is_read(tmp_path):
    p = tmp_path / "export.csv"
    p.write_text("Global_Step,Train/Loss,train/grad_norm,comment\n20,3.1,0.9,a\n10,3.5,1.1,b\n10,3.4,1.0,c\n30,nan,1.0,d\n")
    df = read_metrics_frame(p)
    assert df["step"].tolist() == [10, 20, 30]  # sorted; a repeated step keeps its last record
    assert df["loss"].iloc[0] == 3.4 and math.isnan(df["loss"].iloc[2])
    assert df["grad_norm"].tolist() == [1.0, 0.9, 1.0]
    assert df["comment"].tolist() == ["c", "a", "d"]


@pytest.mark.parametrize("text,match", [
    ("step,val\n1,2\n", "no loss column"),
    ("loss\n1\n", "no step column"),
    ("step,loss\n1,abc\n", "'loss' row 1: value 'abc' is not a number"),
    ("step,loss\n-1,2\n", "not a non-negative whole number"),
    ("", "empty"),
])
def test_unusable_metrics_files_are_named_errors(tmp_path, text, match):
    p = tmp_path / "m.csv"
    p.write_text(text)
    with pytest.raises(MetricsError, match=match):
        read_metrics_frame(p)


def test_a_torn_last_line_of_metrics_jsonl_is_ignored(tmp_path):
    lines = [json.dumps({"step": i, "loss": 3.0 - 0.1 * i, "extra": {"total_loss": 1.0}}) for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    df = read_metrics_frame(tmp_path)
    assert df["step"].tolist() == [0, 1, 2] and "extra.total_loss" in df.columns


# ---- the command ----------------------------------------------------------------------------


def test_compare_reads_a_hand_written_csv_and_writes_json_and_png(tmp_path):
    rows = ["step,tokens,loss,grad_norm"]
    for s in range(0, 400, 4):
        rows.append(f"{s},{(s + 1) * 4096},{2.2 + 2.8 * math.exp(-s / 70) + 0.004 * math.sin(s):.5f},{0.7 + 0.01 * math.cos(s):.4f}")
    (tmp_path / "hand.csv").write_text("\n".join(rows) + "\n")
    steps = np.arange(0, 400, 4)
    forecast_file(tmp_path / "fc.json", steps, 2.2 + 2.8 * np.exp(-steps / 70), 0.02)
    r = run_cli(["compare", "--metrics", "hand.csv", "--forecast", "fc.json", "--json", "--png", "out.png"], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["flags"] == [] and doc["summary"]["step"] == 396
    assert doc["summary"]["band_lo"] < doc["summary"]["loss_smoothed"] < doc["summary"]["band_hi"]
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_exits_3_on_a_critical_flag_and_prints_a_table(tmp_path):
    rows = ["step,loss,grad_norm"] + [f"{s},{3.0 - 0.001 * s if s < 150 else 'nan'},0.8" for s in range(200)]
    (tmp_path / "bad.csv").write_text("\n".join(rows) + "\n")
    r = run_cli(["compare", "--metrics", "bad.csv"], tmp_path)
    assert r.returncode == 3, r.stderr
    assert "non_finite" in r.stdout and "critical" in r.stdout


def test_compare_bad_inputs_are_one_line_errors_and_write_nothing(tmp_path):
    (tmp_path / "noloss.csv").write_text("step,val\n1,2\n2,3\n")
    r = run_cli(["compare", "--metrics", "noloss.csv", "--png", "x.png"], tmp_path)
    err = " ".join(r.stderr.split())  # rich wraps long lines
    assert r.returncode == 2 and "no loss column" in err and "Traceback" not in err
    r = run_cli(["compare", "0123456789abcdef", "--png", "x.png", "--root", str(tmp_path / "ledger")], tmp_path)
    assert r.returncode == 2 and "unknown run id '0123456789abcdef'" in " ".join(r.stderr.split())
    assert not (tmp_path / "x.png").exists()


def test_compare_follow_rereads_the_growing_run_until_its_status_says_done(tmp_path):
    """`compare --follow` reports step 49 first; only then are more records (ending in NaN) appended
    and the status set to diverged: the command must re-read, catch the NaN, and stop."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running"}))
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 3.0 - 0.001 * s, "grad_norm": 0.8}) + "\n" for s in range(50)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([*LADDER, "compare", str(run), "--follow", "--interval", "0.3", "--max-wait", "60", "--json"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stderr.readline()
        assert "step 49 (running)" in first, first
        with metrics.open("a") as f:
            for s in range(50, 80):
                f.write(json.dumps({"step": s, "loss": float("nan") if s >= 70 else 3.0 - 0.001 * s, "grad_norm": 0.8}) + "\n")
        (run / "status.json").write_text(json.dumps({"state": "diverged", "step": 70}))
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 3, err
    doc = json.loads(out)
    assert doc["summary"]["step"] == 79
    assert {"non_finite", "run_diverged"} <= {f["kind"] for f in doc["flags"]}


def test_loss_jump_is_judged_against_the_runs_own_noise():
    """Batch-to-batch noise of a small run moves its smoothed loss 10% off its running minimum;
    that is not a jump. The same run climbing 60% is."""
    rng = np.random.default_rng(3)
    steps = np.arange(400)
    loss = 2.7 + 0.5 * np.exp(-steps / 80) + 0.17 * rng.standard_normal(400)
    assert "loss_jump" not in kinds(monitor(pd.DataFrame({"step": steps, "loss": loss})))
    loss[300:] += np.linspace(0, 1.6, 100)
    f = flag(monitor(pd.DataFrame({"step": steps, "loss": loss})), "loss_jump")
    assert f.severity == "critical" and 300 <= f.first_step <= 360
