"""`ladder train` through the submission's worker: a finished run is left as it is, and
--no-resume trains it again from scratch with its old records kept aside."""

from __future__ import annotations

from pathlib import Path

from core.rundir import RunDir
from core.spec import save_spec
from tests import cli_fork
from tests.support import tiny_spec

REPO = Path(__file__).resolve().parents[2]


def test_a_finished_run_is_left_alone_and_no_resume_trains_it_again(tmp_path):
    spec = save_spec(tiny_spec("again", steps=4, checkpoint_every=2), tmp_path / "s.yaml")
    run = tmp_path / "run"
    first = cli_fork.ladder("train", spec, "--run-dir", run, "--quiet", cwd=tmp_path, timeout=600)
    assert first.returncode == 0 and "finished step 4/4" in first.stderr, first.stderr[-3000:]
    whole = run.joinpath("metrics.jsonl").read_bytes()
    again = cli_fork.ladder("train", spec, "--run-dir", run, "--quiet", cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and "already finished" in again.stderr, again.stderr[-3000:]
    assert run.joinpath("metrics.jsonl").read_bytes() == whole
    fresh = cli_fork.ladder("train", spec, "--run-dir", run, "--quiet", "--no-resume", cwd=tmp_path, timeout=600)
    assert fresh.returncode == 0 and "finished step 4/4" in fresh.stderr, fresh.stderr[-3000:]
    assert [r["step"] for r in RunDir(run).read_metrics()] == [0, 1, 2, 3]
    assert [p.read_bytes() for p in run.glob("metrics.jsonl.*.bak")] == [whole]
    assert not list((run / "locks").glob("*.lock"))  # the claim was released
