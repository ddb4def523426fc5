"""`ladder status` fits an 80-column terminal by giving up whole columns, least useful first,
instead of cutting every cell down to a letter."""

from __future__ import annotations

import os
from pathlib import Path

from ladder.commands.status import fit_columns, status_rows
from ladder.ledger import RunRecord
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]


def record(name: str, **kw) -> RunRecord:
    base = dict(experiment="marin-ladder-published", name=name, role="rung", spec_id="0123456789abcdef", engine="torch",
                state="running", step=11419, total_steps=390251, loss=2.71828, tokens_per_s=1234567.0,
                run_dir="/x", mlflow_run_id="ffffeeeeddddcccc", detail="resumed from step 11000 after a preemption")
    return RunRecord(**{**base, **kw})


def test_at_80_columns_the_table_keeps_spec_state_step_and_loss_and_fits():
    recs = [record("d768"), record("d6144-hero", role="hero", experiment="other-ladder")]
    cols, rows = status_rows(recs)
    shown = fit_columns(cols, rows, 80)
    assert {"spec", "state", "step", "loss"} <= set(shown)
    assert "mlflow" not in shown  # the first to go
    need = sum(max([len(c)] + [len(r[c]) for r in rows]) + 3 for c in shown if c != "note") + 1
    assert need <= 80


def test_a_wide_terminal_shows_every_column():
    cols, rows = status_rows([record("d768"), record("hero", role="hero", experiment="b")])
    assert fit_columns(cols, rows, 200) == cols


def test_ladder_status_prints_no_line_wider_than_80_and_whole_spec_names(write_experiment, tmp_path):
    path = write_experiment("narrow", [("rung-with-a-long-name", {}), ("second-rung", {})])
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    out = cli_fork.ladder("status", path, "--root", tmp_path / "root", cwd=tmp_path, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(ln) for ln in lines) <= 80, out.stdout
    assert any("rung-with-a-long-name" in ln for ln in lines), out.stdout
    assert any("state" in ln and "step" in ln for ln in lines), out.stdout
