"""The `ladder` command line as a user meets it: version, help that tells flags from options, plan on
a spec file, and links that open the MLflow UI's training view."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ladder.presets import micro_spec
from ladder.tracking import ui_url
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def ladder(*args: str) -> subprocess.CompletedProcess:
    return cli_fork.ladder(*args, cwd=REPO, env=ENV, timeout=600)


def test_version_prints_the_package_version():
    out = ladder("--version")
    assert out.returncode == 0 and re.fullmatch(r"ladder \(moe-ladder\) \d+\.\d+\.\d+\S*", out.stdout.strip())


def test_help_shows_a_type_beside_options_that_take_a_value_and_none_beside_flags():
    text = ladder("compare", "--help").stdout
    follow = next(ln for ln in text.splitlines() if "--follow" in ln)
    interval = next(ln for ln in text.splitlines() if "--interval" in ln)
    assert "<bool>" not in text and "<float>" in interval and "<" not in follow


def test_shell_completion_is_offered():
    assert "--install-completion" in ladder("--help").stdout


def test_curve_fit_help_lists_its_list_options():
    text = ladder("curve", "fit", "--help").stdout
    assert all(o in text for o in ("--train", "--predict", "--params", "--schedule"))


def test_plan_takes_a_spec_file(tmp_path):
    (tmp_path / "s.yaml").write_text(micro_spec("one").to_yaml())
    out = ladder("plan", str(tmp_path / "s.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    assert '"name": "one"' in out.stdout


def test_a_spec_file_given_as_an_experiment_is_one_clear_error(tmp_path):
    (tmp_path / "s.yaml").write_text(micro_spec("one").to_yaml())
    out = ladder("submit", str(tmp_path / "s.yaml"))
    assert out.returncode == 2 and "experiment is a Python file" in out.stderr and "internal" not in out.stderr


def test_the_mlflow_ui_link_opens_the_experiment_in_the_training_view():
    assert ui_url("http://127.0.0.1:5000/", "3") == "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning"


def test_a_path_is_printed_whole_when_the_output_is_not_a_terminal(tmp_path):
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "plots"
    deep.mkdir(parents=True)
    (tmp_path / "m.csv").write_text("step,loss\n" + "".join(f"{i},{3 - 0.01 * i}\n" for i in range(30)))
    env = {k: v for k, v in ENV.items() if k != "COLUMNS"}
    out = cli_fork.ladder("compare", "--metrics", tmp_path / "m.csv", "--png", deep / "curve.png", cwd=REPO, env=env,
                          timeout=600)
    assert out.returncode == 0, out.stderr
    assert f"plot: {deep / 'curve.png'}" in out.stdout.splitlines()
