"""`ladder spec from-run`: a spec YAML for a run another stack trains, from its config file, so the
forecast, the schedule-aware band and `replan` work for it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import yaml
from core.fsutil import atomic_write_text
from core.safeload import parse_yaml
from core.costs import fmt_count, param_counts
from ladder.errors import LadderError
from ladder.stack_config import STACKS, detect_stack, load_stack_config, spec_from_stack

spec_app = typer.Typer(help="Specs for runs this project did not launch.", no_args_is_help=True)


def parse_sets(pairs: list[str] | None) -> dict:
    """["data.total_tokens=1e12", "hardware.n_gpus=64"] -> {dotted: value} (YAML scalars)."""
    out = {}
    for p in pairs or []:
        if "=" not in p:
            raise LadderError(f"--set {p!r}: expected FIELD=VALUE, e.g. --set data.total_tokens=1000000000")
        k, v = p.split("=", 1)
        out[k.strip()] = _value(v.strip(), f"--set {k.strip()}")
    return out


def _value(v: str, origin: str):
    """A number where it reads as one (1e12 is 10**12, a whole number), else a YAML scalar."""
    try:
        return int(v)
    except ValueError:
        pass
    try:
        x = float(v)
        return int(x) if x.is_integer() and "e" in v.lower() else x
    except ValueError:
        pass
    try:
        return parse_yaml(v, origin)
    except yaml.YAMLError as e:
        raise LadderError(f"{origin}={v!r}: not a YAML value ({str(e).splitlines()[0]})") from None


@spec_app.command("from-run")
def from_run_cmd(
    config: str = typer.Option(..., "--config", help="the stack's config (OLMo-core: the experiment's config.json; "
                               "Levanter/Marin: the train_lm YAML; torchtitan: the job TOML), or a W&B run's config: "
                               "wandb:DIR or wandb:ENTITY/PROJECT/RUN_ID"),
    name: str = typer.Option(..., "--name", help="the spec's name (letters, digits, . _ + -)"),
    stack: str = typer.Option("auto", "--stack", help="which stack wrote the config: auto (from the file), "
                              + ", ".join(STACKS)),
    out: Path = typer.Option(..., "--out", help="where to write the spec YAML"),
    sets: Optional[list[str]] = typer.Option(None, "--set", help="change or add a field, FIELD=VALUE (repeatable)"),
    role: str = typer.Option("hero", "--role", help="rung, hero or branch"),
) -> None:
    """Write a spec YAML for a run another stack trains, from its config file and a few flags.

    What the config leaves out takes the stack's own default; every field that has no place in a
    spec is named in one warning line."""
    if stack != "auto" and stack not in STACKS:
        raise LadderError(f"--stack {stack!r}: known stacks are auto, {', '.join(STACKS)}")
    if out.is_dir():
        raise LadderError(f"--out {out}: is a directory; give the spec file's path")
    cfg = load_stack_config(config)
    if stack == "auto":
        stack = detect_stack(cfg, str(config))
    notes: list[str] = []
    spec = spec_from_stack(stack, cfg, name, {"role": role, **parse_sets(sets)}, str(config), notes)
    atomic_write_text(out, spec.to_yaml())
    pc = param_counts(spec.model)
    typer.echo(f"{out}: spec {spec.name} ({spec.id}) from {stack}'s config, {spec.total_steps} steps of "
               f"{spec.data.tokens_per_step} tokens, {spec.schedule.decay} decay to {spec.schedule.min_lr_ratio:g} x "
               f"{spec.optim.peak_lr:g}; {fmt_count(pc['total'])} parameters, {fmt_count(pc['active'])} active "
               f"({fmt_count(pc['active'] + pc['embedding'] + pc['lm_head'])} with embeddings)")
    if notes:
        typer.echo(f"warning: not carried over from {config}: {'; '.join(notes)}", err=True)


def register(app: typer.Typer) -> None:
    app.add_typer(spec_app, name="spec")
