"""`ladder replan`: contingency options for a live run, each a new versioned spec with a forecast.

`--apply N` submits option N as a continuation: the option's run dir (ledger layout) is seeded
with the parent's checkpoint at lineage.resume_step and the parent's metrics before it, then the
controller trains it like any spec (resuming from that checkpoint).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ladder.errors import LadderError
from analysis.monitor.watch import MonitorSettings, load_forecast
from engines.checkpoint import init_from_checkpoint, step_dir_name
from ladder import ledger
from ladder.commands.compare import load_inputs, parse_overrides
from ladder.controller import submit
from ladder.experiment import Experiment
from ladder.stack_config import detect_stack, load_stack_config
from ladder.stack_write import STACK_SUFFIX, stack_form
from core.fsutil import atomic_write_text


def render(plan, console: Console) -> None:
    st = plan.state
    console.print(
        f"run {st.spec.name} ({st.spec.id}) at step {st.step + 1}/{st.spec.total_steps} "
        f"({st.budget_frac:.0%} of its tokens), {st.tokens_per_s:,.0f} tokens/s ({st.tokens_per_s_source}); "
        f"kept checkpoints {st.checkpoints or 'none'}" + (" (assumed)" if st.checkpoints_assumed else ""),
        highlight=False,
    )
    if plan.deadline:
        from analysis.replan.contingency import _iso

        console.print(f"deadline {_iso(plan.deadline)}", highlight=False)
    for f in st.report.flags:
        console.print(f"  flag {f.severity} {f.kind} @ {f.first_step}: {f.evidence.get('text', '')}", highlight=False)
    t = Table(title="replan options", header_style="bold")
    for col in ("#", "option", "resume", "steps", "finish", "device-h", "final loss (90%)", "note"):
        t.add_column(col, overflow="fold")
    for r in plan.rows():
        loss = "-"
        if r.forecast_loss is not None:
            loss = f"{r.forecast_loss:.4f} [{r.forecast_lo:.4f}, {r.forecast_hi:.4f}]"
        finish = r.finish or "-"
        if r.meets_deadline is False:
            finish += " (late)"
        style = "" if r.allowed else "dim"
        t.add_row(str(r.n), f"{r.kind}: {r.title}", "-" if r.resume_step is None else str(r.resume_step),
                  "-" if r.total_steps is None else str(r.total_steps), finish,
                  "-" if r.device_hours is None else f"{r.device_hours:.3g}", loss,
                  " ".join(x for x in (r.note, f"-> {r.spec_path}" if r.spec_path else "") if x), style=style)
    if plan.options:
        console.print(t)
    if plan.context_gate:
        console.print(f"context gate: {plan.context_gate.get('note')}", highlight=False)
    for n in plan.notes:
        console.print(f"note: {n}", highlight=False)
    console.print(f"[bold]recommendation:[/] {plan.recommendation}", highlight=False)


def check_apply(plan, n: int):
    """Option n (1-based) if it can be applied; else LadderError (before anything is written)."""
    if not 1 <= n <= len(plan.options):
        raise LadderError(f"--apply {n}: there are options 1..{len(plan.options)}")
    opt = plan.options[n - 1]
    if opt.kind == "keep":
        raise LadderError("--apply 1 (keep): nothing to submit; the run goes on as it is")
    if not opt.allowed or opt.spec is None:
        raise LadderError(f"--apply {n} ({opt.kind}) is refused: {opt.note}")
    return opt


def apply_option(plan, n: int, root: Optional[str], console: Console) -> dict:
    """Submit option n (1-based) as a continuation of the run through the controller."""
    opt = check_apply(plan, n)
    parent_dir = plan.state.run_dir
    if parent_dir is None:
        raise LadderError("--apply needs the run's directory (its checkpoints): give RUN_ID, not --metrics of a file elsewhere")
    parent_dir = Path(parent_dir).resolve()
    # Ledger layout: <root>/runs/<experiment>/<name>-<id>; a run dir elsewhere continues beside it.
    if root is None and parent_dir.parent.parent.name == "runs":
        root_path = parent_dir.parent.parent.parent
    else:
        root_path = ledger.ladder_root(root)
    experiment = parent_dir.parent.name if parent_dir.parent.parent.name == "runs" else "replans"
    child_dir = ledger.run_dir_for(root_path, experiment, opt.spec)
    step = int(opt.resume_step or 0)
    if step > 0:
        from_dir = Path(opt.resume_dir).resolve() if opt.resume_dir else parent_dir
        src = from_dir / "checkpoints" / step_dir_name(step)
        if not src.exists():
            raise LadderError(f"--apply {n}: the parent's checkpoint {src} is gone (kept: {plan.state.checkpoints})")
        init_from_checkpoint(child_dir, src, metrics_from=from_dir)
    ledger.write_spec_file(child_dir, opt.spec)

    exp = Experiment(name=experiment, rungs=(opt.spec,))
    console.print(f"submitting option {n} ({opt.kind}) as {opt.spec.name} ({opt.spec.id}) from step {step} into {child_dir}",
                  highlight=False)
    result = submit(exp, only=f"^{re.escape(opt.spec.name)}$", include_hero=True, root=root_path, console=console)
    return {"run_dir": str(child_dir), "spec_id": opt.spec.id, "ok": bool(result.ok)}


def write_stack_forms(plan, paths: dict[str, str], cfg: dict, config: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Beside each option's spec YAML, the option in the run's own stack's form (ladder/stack_write.py);
    returns the paths (kind.<stack> -> file) and, per file, what that form cannot say."""
    stack = detect_stack(cfg, str(config))
    text = config.read_text() if config.suffix == ".toml" else None
    paths, notes = dict(paths), {}
    for o in plan.options:
        if not o.path or o.spec is None:
            continue
        body, said_not = stack_form(stack, cfg, o.spec, o.resume_step, text)
        target = Path(o.path).with_suffix("").with_suffix(f".{STACK_SUFFIX[stack]}")
        atomic_write_text(target, body)
        paths[f"{o.kind}.{stack}"] = str(target)
        notes[str(target)] = said_not
    return paths, notes


def replan_cmd(
    run: Optional[str] = typer.Argument(None, help="spec id in the ledger, a run directory, mlflow:RUN_ID, wandb:DIR "
                                        "or wandb:ENTITY/PROJECT/RUN_ID"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="metrics.jsonl or an exported CSV"),
    spec_path: Optional[str] = typer.Option(None, "--spec", help="the run's spec YAML (default: the run's own spec.yaml)"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="finish by this date (ISO, UTC if no zone)"),
    days: Optional[float] = typer.Option(None, "--days", help="finish within this many days from now"),
    tokens_per_s: Optional[float] = typer.Option(None, "--tokens-per-s", help="throughput to plan with (default: measured)"),
    forecast: Optional[str] = typer.Option(None, "--forecast", help="forecast.json, for the monitor's band flags"),
    out: Optional[str] = typer.Option(None, "--out", help="directory for the option specs and replan.json"),
    force: bool = typer.Option(False, "--force", help="allow a horizon change past the first quarter of the budget"),
    lr_factor: float = typer.Option(0.5, "--lr-factor", help="peak-LR multiplier of the lower-LR rewind"),
    settings_path: Optional[str] = typer.Option(None, "--settings", help="YAML of monitor thresholds"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="monitor threshold NAME=VALUE (repeatable)"),
    loss_col: Optional[str] = typer.Option(None, "--loss-col", help="the CSV's loss column, if not a usual name"),
    metric_names: Optional[str] = typer.Option(
        None, "--metric-names", help="the stack's metric names: olmo-core, levanter, marin, torchtitan, or a YAML map"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI of an mlflow:RUN_ID"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    apply: Optional[int] = typer.Option(None, "--apply", help="submit option N as a continuation of the run"),
    root: Optional[str] = typer.Option(None, "--root", help="ledger root (default: the ledger's own)"),
    stack_config: Optional[Path] = typer.Option(
        None, "--stack-config", help="the run's own config (OLMo-core config.json, Levanter YAML, torchtitan "
        "TOML): each option is also written in that stack's form beside its spec"),
) -> None:
    """Options for a live run: keep, shorten the horizon, re-time the mix, fix drops, rewind a divergence."""
    import time

    from analysis.replan.contingency import ReplanError, RunState, make_replan, parse_deadline, write_replan

    if not 0 < lr_factor < 1:
        raise LadderError(f"--lr-factor must be between 0 and 1 (got {lr_factor})")
    if days is not None and not 0 < days <= 36500:
        raise LadderError(f"--days must be a positive number of days up to 36500 (got {days})")
    now = time.time()
    settings = MonitorSettings.load(settings_path, parse_overrides(overrides))
    due = parse_deadline(deadline, days, now)
    fc = load_forecast(forecast) if forecast else None
    ref, df, spec = load_inputs(run, metrics, spec_path, root, loss_col, tracking_uri, metric_names)
    if spec is None:
        raise LadderError(f"{run or metrics}: no spec.yaml beside the run; give --spec (`ladder spec from-run` writes one)")
    try:
        state = RunState.build(df, spec, ref, tokens_per_s=tokens_per_s, forecast=fc, settings=settings, now=now)
        plan = make_replan(state, due, force=force, lr_factor=lr_factor)
    except ReplanError as e:
        raise LadderError(str(e)) from None
    if apply is not None:
        check_apply(plan, apply)
    if out is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        base = ref.run_dir if ref.run_dir is not None else Path(".")
        out = str(Path(base) / "replans" / stamp)
    stack_cfg = load_stack_config(stack_config) if stack_config is not None else None
    paths = write_replan(plan, out)
    stack_notes: dict[str, list[str]] = {}
    if stack_cfg is not None:
        paths, stack_notes = write_stack_forms(plan, paths, stack_cfg, stack_config)
    console = Console(stderr=True) if as_json else (Console() if sys.stdout.isatty() else Console(width=180))
    if not as_json:
        render(plan, console)
        console.print(f"written: {out}", highlight=False, soft_wrap=True)
        for path, notes in stack_notes.items():
            console.print(f"written: {path}" + (f" (not said there: {'; '.join(notes)})" if notes else ""),
                          highlight=False, soft_wrap=True)
    applied = apply_option(plan, apply, root, console) if apply is not None else None
    if as_json:
        print(json.dumps({**plan.to_dict(), "out": out, "paths": paths, "stack_forms": stack_notes, "applied": applied},
                         indent=2, default=str))
    elif applied:
        console.print(f"applied: option {apply} runs in {applied['run_dir']}"
                      + ("" if applied["ok"] else " (it did not finish: see `ladder status`)"), highlight=False)
    if applied is not None and not applied["ok"]:
        raise SystemExit(1)


def register(app: typer.Typer) -> None:
    app.command("replan")(replan_cmd)
