"""A ladder whose losses do not fall with compute is refused by `ladder forecast` in one line
(exit 2, naming the rungs, nothing written), and `ladder report` refuses a forecast.json whose
hero loss is not a number instead of failing in matplotlib."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests import cli_fork

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# the smallest rung learns, the larger ones barely move: losses rise with compute
FLAT = textwrap.dedent(
    """
    from ladder.experiment import Experiment
    from ladder.presets import micro_spec

    def rung(name, d, steps, lr, role="rung"):
        return micro_spec(name, role=role, **{
            "model.d_model": d, "model.n_heads": d // 8, "model.n_kv_heads": d // 8, "model.n_layers": 1,
            "model.latent_dim": d // 2, "model.expert_hidden": d // 2, "model.shared_hidden": d,
            "data.seq_len": 64, "data.batch_size": 8, "data.total_tokens": 64 * 8 * steps,
            "optim.peak_lr": lr, "run.eval_every": 10, "run.eval_batches": 2, "run.checkpoint_every": 1000})

    EXPERIMENT = Experiment(
        name="flat",
        rungs=(rung("r16", 16, 30, 0.01), rung("r24", 24, 40, 1e-7), rung("r32", 32, 50, 1e-7)),
        hero=rung("hero", 64, 200, 1e-3, role="hero"),
    )
    """
)


def _ladder(*args: str) -> subprocess.CompletedProcess:
    return cli_fork.ladder(*args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)


def test_a_ladder_whose_losses_do_not_fall_is_refused_in_one_line_naming_its_rungs(tmp_path):
    exp = tmp_path / "flat.py"
    exp.write_text(FLAT)
    root = str(tmp_path / "root")
    sub = _ladder("submit", str(exp), "--local", "--no-tracking", "--root", root)
    assert sub.returncode == 0, sub.stderr[-3000:]
    res = _ladder("forecast", str(exp), "--no-tracking", "--root", root)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    text = " ".join(ln.strip() for ln in lines)  # a long line may wrap at the terminal width
    assert lines[0].startswith("error: cannot forecast: the rungs' final losses do not fall as compute grows"), text
    assert "Traceback" not in res.stderr and all(n in text for n in ("r16", "r24", "r32")), text
    assert not list(Path(root).glob("analysis/flat/forecast*.json"))


def test_report_refuses_a_forecast_whose_hero_loss_is_not_a_number(tmp_path):
    exp = tmp_path / "flat.py"
    exp.write_text(FLAT)
    adir = tmp_path / "root" / "analysis" / "flat"
    adir.mkdir(parents=True)
    (adir / "forecast.json").write_text(json.dumps({"hero": {"name": "hero", "final_loss": {
        "mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "level": 0.9}}}))
    res = _ladder("report", str(exp), "--out", str(tmp_path / "report"), "--no-tracking", "--root", str(tmp_path / "root"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "hero final loss is not a number" in res.stderr, res.stderr[-2000:]
