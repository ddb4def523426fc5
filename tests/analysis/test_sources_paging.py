"""An MLflow run read in pages, and again with only what was logged since (a real MLflow SQLite
store; the server path is tests/analysis/test_sources.py)."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from analysis.runs.names import load_metric_names
from analysis.runs.metrics import MetricsError
from analysis.runs.sources import MlflowSource, open_source


def log(c: MlflowClient, run_id: str, first: int, last: int, t0: int = 1_700_000_000_000) -> None:
    ms = []
    for s in range(first, last + 1):
        ms += [Metric("train/CE loss", 3.0 - 0.001 * s, t0 + s, s), Metric("optim/total grad norm", 0.5, t0 + s, s)]
        if s % 10 == 0:
            ms.append(Metric("eval/lm/c4/CE loss", 3.1 - 0.001 * s, t0 + s, s))
    c.log_batch(run_id, metrics=ms)


@pytest.fixture
def run(seeded_root):
    uri = f"sqlite:///{seeded_root / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    exp_id = c.create_experiment("paging", artifact_location=(seeded_root / "artifacts").as_uri())
    run_id = c.create_run(exp_id).info.run_id
    return uri, c, run_id


def test_a_run_is_read_in_pages_and_a_second_read_fetches_only_the_new_points(run):
    uri, c, run_id = run
    log(c, run_id, 1, 50)
    src = MlflowSource(uri, run_id, load_metric_names("olmo-core"), page_size=7)
    df = src.read()
    assert list(df["step"]) == list(range(1, 51))
    assert src.points_fetched == 50 + 50 + 5
    assert src.requests >= (50 // 7) * 2  # the loss alone needs 8 pages
    log(c, run_id, 51, 60)
    df = src.read()
    assert list(df["step"]) == list(range(1, 61))
    assert src.points_fetched == 60 + 60 + 6  # nothing fetched twice
    np.testing.assert_allclose(df["loss"], 3.0 - 0.001 * df["step"])


def test_eval_steps_do_not_make_rows_without_a_loss(run):
    uri, c, run_id = run
    c.log_batch(run_id, metrics=[Metric("train/CE loss", 3.0, 0, s) for s in (1, 2, 3)]
                + [Metric("eval/lm/c4/CE loss", 3.2, 0, 5)])
    df = MlflowSource(uri, run_id, load_metric_names("olmo-core")).read()
    assert list(df["step"]) == [1, 2, 3] and np.isfinite(df["loss"]).all()


def test_a_run_of_other_names_without_a_map_says_to_name_the_stack(run):
    uri, c, run_id = run
    log(c, run_id, 1, 5)
    with pytest.raises(MetricsError, match="--metric-names"):
        MlflowSource(uri, run_id).read()


def test_an_unknown_run_id_is_one_clear_error(run):
    uri, _, _ = run
    with pytest.raises(MetricsError, match="no such run"):
        open_source("mlflow:0123456789abcdef", tracking_uri=uri)


def test_a_run_this_project_logged_brings_its_spec_from_its_artifact(run, tmp_path):
    from core.spec import save_spec
    from ladder.presets import micro_spec

    uri, c, run_id = run
    spec = micro_spec("logged")
    save_spec(spec, tmp_path / "spec.yaml")
    c.log_artifact(run_id, str(tmp_path / "spec.yaml"))
    assert MlflowSource(uri, run_id).spec.id == spec.id
