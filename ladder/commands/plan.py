"""`ladder plan` (the cost table of an experiment) and `ladder schema` (the spec's JSON schema)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from core import costs
from core.spec import Spec, load_spec
from engines.epochs import spec_epochs
from engines.tokenizer import check_vocab
from ladder.experiment import check_engine, load_experiment
from analysis.runs.replicates import family_key
from ladder.preflight import memory_problem


SPEC_SUFFIXES = (".yaml", ".yml", ".json")
GRID_MIN_FAMILIES = 6  # analysis.forecast.grid.MIN_POINTS (importing it would bring scipy into the CLI)


def plan_rows(experiment: str) -> tuple[list[dict], dict]:
    """One row per spec of an experiment file (rungs, hero, extras such as replicates and cooldown
    branches), each with its role in the plan ("rung", "hero", "extra") and, for a replicate (a run
    that differs from another of the experiment only in its seed), the spec it replicates; or the
    rows of one or more spec files (YAML/JSON) given together."""
    paths = [p.strip() for p in str(experiment).split(",")]
    if all(Path(p).suffix in SPEC_SUFFIXES for p in paths):
        specs = [load_spec(p) for p in paths]
        hero = next((s for s in specs if s.role == "hero"), None)
        name = ", ".join(Path(p).name for p in paths)
        kinds = ["hero" if s is hero else "rung" for s in specs]
        ladder = [s for s in specs if s is not hero]
    else:
        exp = load_experiment(experiment)
        specs, hero, name = exp.all_specs(), exp.hero, exp.name
        kinds = [*(["rung"] * len(exp.rungs)), *(["hero"] if exp.hero else []), *(["extra"] * len(exp.extras))]
        ladder = list(exp.rungs)
    rows = costs.plan(specs, hero)
    first: dict[str, str] = {}
    for row, spec, kind in zip(rows, specs, kinds):
        row["data"] = spec_epochs(spec)  # tokenizer, epochs over each source, and how the counts are known
        row["plan_role"] = kind
        key = family_key(spec)
        row["replicate_of"] = first.get(key)
        first.setdefault(key, spec.name)
    summary = {"experiment": name}
    reps = [s for s, r in zip(specs, rows) if r["replicate_of"]]
    summary["replicates"] = [s.name for s in reps]
    summary["replicate_gpu_hours"] = sum(r["gpu_hours"] for r in rows if r["replicate_of"])
    summary["gpu_hours"] = sum(r["gpu_hours"] for r in rows)
    if hero is not None and ladder:
        summary["ladder_share_of_hero"] = costs.ladder_share(ladder, hero)
        summary["replicate_share_of_hero"] = costs.ladder_share(reps, hero) if reps else 0.0
    if ladder:
        summary["design"] = ladder_design(ladder, hero)
    return rows, summary


def ladder_design(rungs: list[Spec], hero: Spec | None) -> dict:
    """The ladder's design as the forecast will read it: each size's budgets (tokens per active
    parameter), whether sizes and tokens vary independently (a grid: L(N, D) is identified) or all
    runs sit on one tokens-per-parameter line (only L(C)), and the rungs whose batch differs from
    the hero's."""
    budgets = costs.budgets_by_size((f"d{s.model.d_model}/{s.model.n_layers}", costs.tokens_per_active_param(s))
                                    for s in rungs)
    multi = sum(len(b) >= 2 for b in budgets.values())
    firsts = [b[0] for b in budgets.values()]
    out = {"budgets": {k: sorted(v) for k, v in budgets.items()}, "grid": multi >= 2,
           "one_line": all(len(b) == 1 for b in budgets.values()) and costs.same_budget(max(firsts), min(firsts))}
    if hero is not None:
        hb = hero.data.batch_size * hero.data.seq_len
        out["hero_batch_tokens"] = hb
        out["other_batch"] = {s.name: s.data.batch_size * s.data.seq_len for s in rungs
                              if s.data.batch_size * s.data.seq_len != hb}
    return out


def render_plan(rows: list[dict], summary: dict, console: Console | None = None) -> None:
    import sys

    console = console or (Console() if sys.stdout.isatty() else Console(width=170))
    t = Table(title=f"plan: {summary['experiment']}", header_style="bold")
    for col in ("rung", "layers", "d", "total", "active", "tokens", "tok/act", "FLOPs", "% hero",
                "mem/GPU", "a2a B/tok", "GPUs", "GPU-h", "days", "epochs"):
        t.add_column(col, justify="right", no_wrap=col == "rung")
    for r in rows:
        share = f"{100 * r['share_of_hero']:.3g}%" if r["share_of_hero"] is not None else "-"
        mark = {"hero": " (hero)", "extra": " (extra)"}.get(r.get("plan_role"), "")
        label = r["name"] + (f" (replicate of {r['replicate_of']})" if r.get("replicate_of") else mark)
        t.add_row(
            label, str(r["layers"]), str(r["d_model"]), costs.fmt_count(r["total_params"]),
            costs.fmt_count(r["active_params"]), costs.fmt_count(r["tokens"]), f"{r['tokens_per_active_param']:.3g}",
            costs.fmt_sci(r["flops"]), share, f"{r['memory_per_gpu_gb']:.1f} GB" + ("" if r["memory_fits"] else " !"),
            f"{r['a2a_bytes_per_token'] / 1e6:.2f} MB", str(r["gpus"]), f"{r['gpu_hours']:.3g}", f"{r['days']:.3g}",
            _max_epochs(r.get("data")),
        )
    console.print(t)
    mfu = {r["mfu"] for r in rows}
    systems = {r["system"] for r in rows}
    console.print(f"GPU-hours and days at MFU {', '.join(f'{m:.0%}' for m in sorted(mfu))} on {', '.join(sorted(systems))}.")
    if "ladder_share_of_hero" in summary:
        console.print(f"ladder compute: {100 * summary['ladder_share_of_hero']:.2f}% of the hero's.")
    if summary.get("replicates"):
        share = summary.get("replicate_share_of_hero")
        console.print(f"replicates ({', '.join(summary['replicates'])}): {summary['replicate_gpu_hours']:.3g} GPU-h of "
                      f"{summary['gpu_hours']:.3g} in all" + (f", {100 * share:.3g}% of the hero's compute" if share else "")
                      + "; they measure the ladder's seed-to-seed noise.", highlight=False)
    if summary.get("design"):
        _print_design(summary["design"], console)
    _print_data(rows, console)


def _print_design(d: dict, console: Console) -> None:
    sizes = "; ".join(f"{k} at {', '.join(f'{b:.3g}' for b in v)}" for k, v in d["budgets"].items())
    families = sum(len(v) for v in d["budgets"].values())
    kind = (f"a grid, but L(N, D) needs at least {GRID_MIN_FAMILIES} families and it has {families}: the forecast fits L(C)"
            if d["grid"] and families < GRID_MIN_FAMILIES else
            "a grid: sizes vary at fixed tokens and tokens at fixed size, so the forecast fits L(N, D)" if d["grid"]
            else "one tokens-per-parameter line: size is not identified (the forecast fits L(C) only)" if d["one_line"]
            else "too few sizes at several budgets for L(N, D): the forecast fits L(C)")
    console.print(f"design (tokens per active parameter): {sizes}; {kind}.", highlight=False)
    if d.get("other_batch"):
        console.print(f"batch rule: {len(d['other_batch'])} rung(s) train at another batch than the hero's "
                      f"{d['hero_batch_tokens']:,} tokens: " + ", ".join(f"{k} {v:,}" for k, v in d["other_batch"].items())
                      + " (a batch effect inside the law)", style="yellow", highlight=False)
    elif "hero_batch_tokens" in d:
        console.print(f"batch rule: every rung at the hero's batch ({d['hero_batch_tokens']:,} tokens).", highlight=False)


def _max_epochs(data: dict | None) -> str:
    known = [x for x in (data or {}).get("epochs", {}).values() if x is not None]
    if not known:
        return "?"
    mark = "" if all(b == "shards" or b.startswith("manifest") for b in data["basis"].values()) else "~"
    return f"{mark}{max(known):.2f}" + (" !" if max(known) > data["max_epochs"] + 1e-9 else "")


def _print_data(rows: list[dict], console: Console) -> None:
    """Tokenizer and source token counts (shared by the rows), then each row's epochs per source."""
    seen = []
    for r in rows:
        d = r.get("data")
        if not d:
            continue
        line = f"data: tokenizer {d['tokenizer']}; " + ", ".join(
            f"{n} {costs.fmt_count(c) if c is not None else '?'} tokens ({d['basis'][n]})" for n, c in d["source_tokens"].items())
        if line not in seen:
            seen.append(line)
            console.print(line, highlight=False, markup=False)
    console.print("epochs per source: " + "; ".join(
        f"{r['name']} " + " ".join(f"{n} {x:.2f}" if x is not None else f"{n} ?" for n, x in r["data"]["epochs"].items())
        for r in rows if r.get("data")) + " (~: estimated source size; !: above data.max_epochs)",
        highlight=False, markup=False)


def plan_cmd(
    experiment: str = typer.Argument(..., help="experiment file (experiments/marin_535b.py), or spec files "
                                     "(a.yaml or a.yaml,b.yaml)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Parameters, tokens, FLOPs, memory, all-to-all traffic and GPU-hours of every rung."""
    rows, summary = plan_rows(experiment)
    if as_json:
        print(json.dumps({**summary, "rungs": rows}, indent=2))
    else:
        render_plan(rows, summary)


def schema_cmd() -> None:
    """Print the spec's JSON schema."""
    print(json.dumps(Spec.model_json_schema(), indent=2))


def validate_cmd(path: str = typer.Argument(..., help="spec YAML or JSON")) -> None:
    """Validate a spec file and print its id."""
    spec = check_vocab(check_engine(load_spec(path)))
    print(f"{spec.name}: ok, id {spec.id}, {spec.total_steps} steps")
    problem = memory_problem(spec)
    if problem:
        Console(stderr=True).print(f"warning: {problem}; `ladder train` and `ladder submit` refuse it",
                                   style="yellow", highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)
    app.command("schema")(schema_cmd)
    app.command("validate")(validate_cmd)
