"""`ladder replan RUN` without --spec reads the run's own spec.yaml; without one it says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engines.registry import get_engine
from ladder import ledger
from tests import cli_fork
from tests.support import tiny_spec

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def ladder(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return cli_fork.ladder(*args, cwd=cwd, env=env, timeout=600)


def test_replan_of_a_run_dir_uses_its_own_spec_and_of_a_bare_metrics_file_asks_for_one(tmp_path):
    spec = tiny_spec("own-spec", steps=40)
    run_dir = tmp_path / "run"
    ledger.write_spec_file(run_dir, spec)
    for m in get_engine("torch").train(spec, run_dir):
        if m.step >= 11:
            break
    out = ladder("replan", run_dir, "--days", "30", "--tokens-per-s", "1000", "--json", "--out", tmp_path / "rp", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["run"]["spec_id"] == spec.id

    (tmp_path / "elsewhere.jsonl").write_bytes((run_dir / "metrics.jsonl").read_bytes())
    bare = ladder("replan", "--metrics", tmp_path / "elsewhere.jsonl", "--days", "30", cwd=tmp_path)
    assert bare.returncode == 2
    assert len(bare.stderr.strip().splitlines()) == 1 and "--spec" in bare.stderr, bare.stderr
