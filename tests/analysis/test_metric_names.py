"""Metric-name maps: other stacks' names onto this project's, in CSV exports (W&B's too), and the
tokens a run that logs steps only has seen, from its spec."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.runs.names import MetricNamesError, load_metric_names
from analysis.runs.metrics import MetricsError, read_metrics_frame, tokens_from_spec
from ladder.presets import micro_spec

REPO = Path(__file__).resolve().parents[2]


def wandb_panel_csv(path: Path, run: str = "olmoe-1b7b", metrics=("train/CE loss", "optim/total grad norm")) -> Path:
    """The shape of W&B's "Export panel data as CSV": Step, `<run> - <metric>` and its __MIN/__MAX."""
    steps = np.arange(1, 21)
    cols = {"Step": steps}
    for i, m in enumerate(metrics):
        v = 3.0 - 0.01 * steps + i
        cols[f"{run} - {m}"] = v
        cols[f"{run} - {m}__MIN"] = v - 0.1
        cols[f"{run} - {m}__MAX"] = v + 0.1
    pd.DataFrame(cols).to_csv(path, index=False)
    return path


def test_a_wandb_panel_export_under_olmo_core_names_reads_as_loss_and_grad_norm(tmp_path):
    df = read_metrics_frame(wandb_panel_csv(tmp_path / "wandb.csv"), names=load_metric_names("olmo-core"))
    assert list(df["step"]) == list(range(1, 21))
    np.testing.assert_allclose(df["loss"], 3.0 - 0.01 * df["step"])
    np.testing.assert_allclose(df["grad_norm"], 4.0 - 0.01 * df["step"])
    assert not [c for c in df.columns if "__" in c or " - " in c]


def test_a_wandb_export_of_two_runs_is_refused_naming_both(tmp_path):
    a = pd.read_csv(wandb_panel_csv(tmp_path / "a.csv", run="run-a"))
    b = pd.read_csv(wandb_panel_csv(tmp_path / "b.csv", run="run-b")).drop(columns=["Step"])
    pd.concat([a, b], axis=1).to_csv(tmp_path / "two.csv", index=False)
    with pytest.raises(MetricsError, match="2 runs.*run-a, run-b"):
        read_metrics_frame(tmp_path / "two.csv", names=load_metric_names("olmo-core"))


def test_globbed_names_average_eval_sets_and_take_the_first_lr_group(tmp_path):
    pd.DataFrame({
        "_step": [1, 2, 3],
        "train/CE loss": [3.0, 2.9, 2.8],
        "eval/lm/c4_en/CE loss": [3.2, np.nan, 3.0],
        "eval/lm/pile/CE loss": [3.4, np.nan, 3.2],
        "optim/LR (group 1)": [9.0, 9.0, 9.0],
        "optim/LR (group 0)": [1e-4, 2e-4, 3e-4],
    }).to_csv(tmp_path / "olmo.csv", index=False)
    df = read_metrics_frame(tmp_path / "olmo.csv", names=load_metric_names("olmo-core"))
    np.testing.assert_allclose(df["eval_loss"], [3.3, np.nan, 3.1])
    np.testing.assert_allclose(df["lr"], [1e-4, 2e-4, 3e-4])


def test_levanter_router_entropy_is_the_mean_over_layers_and_torchtitan_lr_is_its_optimizers(tmp_path):
    pd.DataFrame({"global_step": [0, 1], "train/loss": [3.0, 2.9], "moe/layer0/routing_entropy": [2.0, 1.0],
                  "moe/layer1/routing_entropy": [4.0, 3.0]}).to_csv(tmp_path / "lev.csv", index=False)
    lev = read_metrics_frame(tmp_path / "lev.csv", names=load_metric_names("marin"))
    np.testing.assert_allclose(lev["router_entropy"], [3.0, 2.0])
    pd.DataFrame({"step": [1, 2], "loss_metrics/global_avg_loss": [3.0, 2.9], "grad_norm": [0.5, 0.6],
                  "lr/AdamW": [1e-4, 2e-4]}).to_csv(tmp_path / "tt.csv", index=False)
    tt = read_metrics_frame(tmp_path / "tt.csv", names=load_metric_names("torchtitan"))
    np.testing.assert_allclose(tt["lr"], [1e-4, 2e-4])
    np.testing.assert_allclose(tt["loss"], [3.0, 2.9])


def test_a_users_yaml_map_starts_from_a_preset_and_overrides_a_name(tmp_path):
    (tmp_path / "names.yaml").write_text("preset: olmo-core\nloss: my/loss\n")
    pd.DataFrame({"_step": [1, 2], "my/loss": [3.0, 2.9], "train/CE loss": [9.0, 9.0],
                  "optim/total grad norm": [0.3, 0.4]}).to_csv(tmp_path / "m.csv", index=False)
    df = read_metrics_frame(tmp_path / "m.csv", names=load_metric_names(tmp_path / "names.yaml"))
    np.testing.assert_allclose(df["loss"], [3.0, 2.9])
    np.testing.assert_allclose(df["grad_norm"], [0.3, 0.4])


def test_a_map_naming_an_unknown_metric_is_refused_naming_it(tmp_path):
    (tmp_path / "bad.yaml").write_text("los: train/loss\n")
    with pytest.raises(MetricNamesError, match="unknown metric 'los'"):
        load_metric_names(tmp_path / "bad.yaml")


def test_tokens_come_from_the_spec_batch_when_a_run_logs_steps_only():
    spec = micro_spec("tok", **{"data.seq_len": 32, "data.batch_size": 4, "data.total_tokens": 128 * 100})
    one_based = tokens_from_spec(pd.DataFrame({"step": [1, 2, 10], "loss": [3.0, 2.9, 2.5]}), spec)
    np.testing.assert_array_equal(one_based["tokens"], [128, 256, 1280])  # step s: s steps done
    zero_based = tokens_from_spec(pd.DataFrame({"step": [0, 1, 9], "loss": [3.0, 2.9, 2.5]}), spec)
    np.testing.assert_array_equal(zero_based["tokens"], [128, 256, 1280])  # step s: s + 1 steps done
    logged = pd.DataFrame({"step": [0], "loss": [3.0], "tokens": [7.0]})
    assert tokens_from_spec(logged, spec)["tokens"].tolist() == [7.0]


def test_compare_with_a_bad_metric_names_argument_says_so_in_one_line_and_exits_2(tmp_path):
    wandb_panel_csv(tmp_path / "w.csv")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "compare", "--metrics", "w.csv", "--metric-names",
                          "olmo-cor"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "olmo-cor" in err[0] and "olmo-core" in err[0], out.stderr
