"""Each stack's metric names as MLflow must store them, and each stack's first step."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.utils.validation import validate_param_and_metric_name

from analysis.runs.names import PRESETS, load_metric_names, mlflow_legal
from analysis.runs.sources import open_source


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_name_has_a_form_mlflow_accepts(preset):
    for entry in load_metric_names(preset).entries.values():
        for name in entry.names:
            assert validate_param_and_metric_name(mlflow_legal(name).replace("*", "0")), name


def test_first_steps_come_from_each_stacks_own_trainer():
    assert {p: load_metric_names(p).first_step for p in ("olmo-core", "levanter", "marin", "torchtitan")} == \
        {"olmo-core": 1, "levanter": 0, "marin": 0, "torchtitan": 1}


def test_an_mlflow_run_of_olmo_core_metrics_reads_its_lr_under_the_name_mlflow_allows(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(uri)
    run = c.create_run(c.create_experiment("olmo"))
    names = {"train/CE loss": 3.0, "optim/total grad norm": 0.5, mlflow_legal("optim/LR (group 0)"): 1e-3}
    c.log_batch(run.info.run_id, metrics=[Metric(k, v - 0.01 * s if "loss" in k else v, 1000 * s, s)
                                          for s in range(1, 11) for k, v in names.items()])
    src = open_source(f"mlflow:{run.info.run_id}", tracking_uri=uri, names=load_metric_names("olmo-core"))
    df = src.read()
    assert list(df["lr"].unique()) == [1e-3] and df["step"].iloc[0] == 1 and df.attrs["first_step"] == 1
