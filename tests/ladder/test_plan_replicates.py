"""`ladder plan` shows every run an experiment asks for: its extras (a hero replicate) as well as its
rungs, each replicate named with the run it replicates, and what the replicates cost."""

import json
import os
from pathlib import Path

from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path, *args):
    return cli_fork.ladder("plan", "experiments/proxy_h200.py", *args, cwd=REPO, timeout=300,
                           env={**os.environ, "MOE_LADDER_CORPUS": str(tmp_path), "COLUMNS": "250"})


def test_the_plan_lists_the_hero_replicate_and_the_replicates_cost(tmp_path):
    res = _plan(tmp_path, "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    rows = {r["name"]: r for r in plan["rungs"]}
    assert rows["hero-d512-seed1"]["plan_role"] == "extra" and rows["hero-d512-seed1"]["replicate_of"] == "hero-d512"
    assert rows["d192-seed1"]["replicate_of"] == "d192" and rows["d192"]["replicate_of"] is None
    assert plan["replicates"] == ["d192-seed1", "d256-seed1", "d320-seed1", "d384-seed1",
                                  "hero-d512-seed1", "hero-d512-seed2", "hero-d512-seed3"]
    reps = sum(rows[n]["gpu_hours"] for n in plan["replicates"])
    assert abs(plan["replicate_gpu_hours"] - reps) < 1e-12 and plan["gpu_hours"] > reps > 0


def test_the_plan_table_names_each_replicate(tmp_path):
    res = _plan(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hero-d512-seed1 (replicate of hero-d512)" in res.stdout and "replicates (d192-seed1" in res.stdout
