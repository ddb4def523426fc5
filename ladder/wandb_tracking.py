"""W&B beside MLflow: this project's runs uploaded to W&B from their run directories.

    results = sync_to_wandb(root, "proxy_cpu", project="my-ladder", mode="offline")

Each run directory (the source of truth) becomes one W&B run whose id is the spec id, named after
the spec, grouped by experiment, with the spec as its config: so `wandb:ENTITY/PROJECT/<spec id>`
names it and a later sync continues the same run (`resume="allow"`). What was uploaded is kept in
`<root>/wandb/synced.json` (spec id -> last step sent, per project and mode), so each sync sends
only the steps logged since; metrics keep this project's names (`loss`, `grad_norm`, `eval_loss`,
...), `extra.*` for an engine's extras. The mode is W&B's: `offline` (the default here: the runs
land under `<root>/wandb/`, and `wandb sync` uploads them later) or `online` (a W&B server and
WANDB_API_KEY).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from core.fsutil import atomic_write_text
from core.rundir import iter_run_dirs, parse_metrics_lines
from core.spec import load_spec
from ladder.errors import LadderError

__all__ = ["WandbSync", "sync_to_wandb"]

STATE_FILE = "synced.json"


@dataclass
class WandbSync:
    experiment: str
    name: str
    spec_id: str
    uploaded: int
    last_step: int | None
    run_dir: str | None = None  # the W&B run directory written (offline)


def _values(rec: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k == "extra" and isinstance(v, dict):
            out.update({f"extra.{ek}": float(ev) for ek, ev in v.items()
                        if isinstance(ev, (int, float)) and not isinstance(ev, bool)})
        elif k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
        elif k != "step" and isinstance(v, float):  # NaN / inf: the record says so, W&B keeps them
            out[k] = v
    return out


def sync_to_wandb(root: str | Path, experiment: str | None = None, project: str | None = None,
                  mode: str | None = None) -> list[WandbSync]:
    """Upload every run under `root`/runs (one experiment, or all) to W&B; returns what each sent."""
    try:
        import wandb
    except ImportError:
        raise LadderError("W&B tracking needs the wandb package: pip install 'moe-ladder[wandb]'") from None

    root = Path(root)
    mode = mode or os.environ.get("WANDB_MODE") or "offline"
    if mode not in ("offline", "online"):
        raise LadderError(f"--wandb-mode {mode!r}: offline or online")
    runs_root = root / "runs"
    exps = [runs_root / experiment] if experiment else sorted(p for p in runs_root.iterdir() if p.is_dir()) \
        if runs_root.is_dir() else []
    wdir = root / "wandb"
    wdir.mkdir(parents=True, exist_ok=True)
    state_path = wdir / STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    out: list[WandbSync] = []
    for exp_dir in exps:
        proj = project or f"ladder-{exp_dir.name}"
        for rd in iter_run_dirs(exp_dir):
            spec = load_spec(rd.spec_path)
            key = f"{mode}/{proj}/{spec.id}"
            done = state.get(key, -1)
            records = [r for r in parse_metrics_lines(rd.metrics_path.read_bytes(), rd.metrics_path)
                       if isinstance(r.get("step"), int) and r["step"] > done] if rd.metrics_path.exists() else []
            if not records:
                out.append(WandbSync(exp_dir.name, spec.name, spec.id, 0, None if done < 0 else done))
                continue
            status = {}
            if (rd.path / "status.json").exists():
                try:
                    status = json.loads((rd.path / "status.json").read_text())
                except json.JSONDecodeError:
                    status = {}
            run = wandb.init(project=proj, id=spec.id, name=spec.name, group=exp_dir.name, dir=str(wdir), mode=mode,
                             resume="allow", config=spec.model_dump(mode="json"), tags=[spec.role, spec.engine],
                             settings=wandb.Settings(x_disable_stats=True, x_disable_meta=True, console="off"),
                             reinit="finish_previous")
            try:
                for rec in records:
                    run.log(_values(rec), step=int(rec["step"]))
            finally:
                failed = str(status.get("state", "")) in ("failed", "diverged")
                run.finish(exit_code=1 if failed else 0)
            last = int(records[-1]["step"])
            state[key] = last
            atomic_write_text(state_path, json.dumps(state, indent=1, sort_keys=True) + "\n")
            out.append(WandbSync(exp_dir.name, spec.name, spec.id, len(records), last,
                                 str(Path(run.dir).parent) if mode == "offline" else None))
    return out
