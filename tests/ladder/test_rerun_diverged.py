"""A diverged run is re-run only on purpose: `ladder train` refuses it in one line naming
--rerun-diverged, and `ladder submit --rerun-diverged` plans it again instead of skipping it."""

import os
import subprocess
import sys

import pytest

from core.rundir import RunDir
from core.spec import save_spec
from tests import cli_fork
from tests.support import tiny_spec


def test_submit_plans_a_diverged_spec_again_only_when_asked(tmp_path):
    from ladder import ledger
    from ladder.controller import plan
    from ladder.experiment import Experiment

    spec = tiny_spec("div")
    exp = Experiment(name="rerun", rungs=(spec,))
    RunDir(ledger.run_dir_for(tmp_path, exp.name, spec)).write_status("diverged", step=3)
    assert [p.action for p in plan(tmp_path, exp, [spec])] == ["skip-diverged"]
    assert [p.action for p in plan(tmp_path, exp, [spec], rerun_diverged=True)] == ["run"]


@pytest.mark.slow
def test_train_refuses_a_diverged_run_unless_asked(tmp_path):
    spec = tiny_spec("nan", steps=30, checkpoint_every=5, **{"optim.peak_lr": 1e6, "optim.grad_clip": 1e9})
    path, run = save_spec(spec, tmp_path / "nan.yaml"), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOE_LADDER_OPTIONS": "cpu_threads=1"}

    def train(*extra):
        return cli_fork.ladder("train", path, "--run-dir", run, "--quiet", *extra, env=env, timeout=300)

    assert train().returncode == 3  # diverged
    refused = train()
    assert refused.returncode == 2 and "--rerun-diverged" in refused.stderr
    assert len([line for line in refused.stderr.splitlines() if line.strip()]) == 1
    again = train("--rerun-diverged")
    assert again.returncode == 3 and "diverged" in again.stderr  # it trained again (and diverged again)


def test_submit_leaving_a_diverged_spec_untrained_is_not_a_success(tmp_path):
    """`ladder submit` says the spec diverged earlier and exits 1, not 0, unless --rerun-diverged."""
    from ladder import ledger
    from ladder.experiment import Experiment

    spec = tiny_spec("div")
    path = tmp_path / "exp.py"
    path.write_text("from ladder.experiment import Experiment\nfrom tests.support import tiny_spec\n"
                    "EXPERIMENT = Experiment(name='rerun', rungs=(tiny_spec('div'),))\n")
    root = tmp_path / ".ladder"
    RunDir(ledger.run_dir_for(root, Experiment(name="rerun", rungs=(spec,)).name, spec)).write_status("diverged", step=3)
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(root), "--no-tracking"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": ""})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "diverged earlier, not rerun" in out.stdout + out.stderr
