"""`ladder plan` shows every run an experiment asks for: its extras (a hero replicate) as well as its
rungs, each replicate named with the run it replicates, and what the replicates cost."""

import json
import os
from pathlib import Path

import pytest

from analysis.forecast.grid import MIN_POINTS
from ladder.commands.plan import GRID_MIN_FAMILIES
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
    assert rows["d384-t6-seed1"]["replicate_of"] == "d384-t6" and rows["d384-t6"]["replicate_of"] is None
    assert plan["replicates"] == ["d384-t6-seed1", "hero-d512-seed1", "hero-d512-seed2", "hero-d512-seed3",
                                  "hero-d512-seed4", "hero-d512-seed5"]
    reps = sum(rows[n]["gpu_hours"] for n in plan["replicates"])
    assert abs(plan["replicate_gpu_hours"] - reps) < 1e-12 and plan["gpu_hours"] > reps > 0


def test_the_plan_table_names_each_replicate(tmp_path):
    res = _plan(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hero-d512-seed1 (replicate of hero-d512)" in res.stdout and "replicates (d384-t6-seed1" in res.stdout


def test_the_plan_says_the_ladder_is_a_grid_at_the_heros_batch(tmp_path):
    plan = json.loads(_plan(tmp_path, "--json").stdout)
    assert plan["design"]["grid"] and not plan["design"]["one_line"] and plan["design"]["other_batch"] == {}
    assert plan["design"]["budgets"]["d512/9"] == pytest.approx([3.0, 4.5], rel=1e-3)


def test_the_plan_names_the_rungs_at_another_batch_than_the_heros(tmp_path):
    res = cli_fork.ladder("plan", "experiments/proxy_h200_straddle.py", cwd=REPO, timeout=300,
                          env={**os.environ, "MOE_LADDER_CORPUS": str(tmp_path), "COLUMNS": "250"})
    assert res.returncode == 0, res.stderr
    assert "one tokens-per-parameter line: size is not identified" in res.stdout
    assert "8 rung(s) train at another batch than the hero's 65,536 tokens" in res.stdout


def test_the_plans_grid_minimum_is_the_forecasts():
    assert GRID_MIN_FAMILIES == MIN_POINTS
