"""`ladder compare` as an alerting tool: each flag and each escalation said once, the exit status
by the worst severity, a quiet mode."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from rich.console import Console

from analysis.monitor.watch import Flag, MonitorReport
from ladder.commands.compare import Announcer
from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]


def report(*flags) -> MonitorReport:
    return MonitorReport([Flag(k, s, step, {"text": f"{k} text"}) for k, s, step in flags], {}, {})


def said(console: Console) -> list[str]:
    return [line for line in console.export_text().splitlines() if line.strip()]


def test_each_flag_is_said_once_and_again_only_when_it_escalates():
    console = Console(record=True, width=200)
    say = Announcer(console, quiet=False)
    say(report(("throughput_low", "info", 10)))
    say(report(("throughput_low", "info", 11)))  # the same flag at a later step: nothing new
    say(report(("throughput_low", "info", 12), ("loss_above_band", "warning", 12)))
    say(report(("throughput_low", "info", 13), ("loss_above_band", "critical", 12)))
    say(report(("throughput_low", "info", 14), ("loss_above_band", "critical", 12)))
    lines = said(console)
    assert len(lines) == 3, lines
    assert "throughput_low @ step 10 (new)" in lines[0]
    assert "loss_above_band @ step 12 (new)" in lines[1] and lines[1].startswith("warning")
    assert "escalated from warning" in lines[2] and lines[2].startswith("critical")


def test_quiet_says_nothing_below_a_warning():
    console = Console(record=True, width=200)
    say = Announcer(console, quiet=True)
    say(report(("throughput_low", "info", 10)))
    assert said(console) == []
    say(report(("throughput_low", "info", 10), ("throughput_drop", "warning", 30)))
    assert len(said(console)) == 1


def _run(tmp_path: Path, records: list[dict], *args: str) -> subprocess.CompletedProcess:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "status.json").write_text(json.dumps({"state": "finished"}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return cli_fork.ladder("compare", run, *args, cwd=tmp_path, env=env, timeout=600)


def test_exit_status_is_the_worst_severity_and_quiet_prints_only_what_warns(tmp_path):
    healthy = [{"step": s, "loss": 3.0 - 0.001 * s, "grad_norm": 0.5} for s in range(100)]
    r = _run(tmp_path, healthy, "--quiet")
    assert r.returncode == 0 and r.stdout.strip() == "", (r.stdout, r.stderr)
    slow = [{**rec, "tokens_per_s": 1000.0 if rec["step"] < 60 else 100.0} for rec in healthy]
    r = _run(tmp_path, slow, "--quiet")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.count("\n") == 1 and "throughput_drop" in r.stdout
    nan = healthy[:50] + [{"step": 50, "loss": float("nan"), "grad_norm": 0.5}]
    r = _run(tmp_path, nan, "--quiet")
    assert r.returncode == 3 and "non_finite" in r.stdout
