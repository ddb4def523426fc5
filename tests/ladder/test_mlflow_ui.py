"""What the MLflow UI shows of a ladder: the experiment page lists every spec's run, linked."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ladder import tracking
from ladder.controller import submit
from ladder.experiment import load_experiment

pytestmark = pytest.mark.slow


def test_the_experiment_description_links_every_specs_run_with_its_state(write_experiment, seeded_root):
    path = write_experiment("ui", [("a", {}), ("b", {"seed": 1})], steps=10)
    result = submit(path, root=seeded_root, console=Console(file=io.StringIO()), local=True)
    assert result.ok
    uri = tracking.default_tracking_uri(seeded_root)
    exp = tracking.client(uri).get_experiment_by_name("ui")
    note = exp.tags[tracking.NOTE_TAG]
    for run in tracking.child_runs(uri, "ui"):
        spec = run.data.tags["rung"]
        assert f"[{spec}](#/experiments/{exp.experiment_id}/runs/{run.info.run_id}/model-metrics?workflowType=machine_learning)" in note
        row = next(ln for ln in note.splitlines() if f"[{spec}]" in ln)
        assert "| finished |" in row
    assert {s.name for s in load_experiment(path).rungs} == {"a", "b"}
