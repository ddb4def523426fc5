"""Where a run directory keeps its sharded checkpoints (`sharded/step_NNNNNNNN/`, each with its
state.json), found without torch.distributed: the launcher and the controller look here before any
rank starts. Writing and reading them is engines/torch/parallel/checkpoint.py's."""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHARDED", "STATE_FILE", "latest_sharded", "list_sharded"]

SHARDED = "sharded"
STATE_FILE = "state.json"


def list_sharded(run_dir: str | Path) -> list[Path]:
    """The run's sharded checkpoints that have their state.json, oldest first."""
    root = Path(run_dir) / SHARDED
    if not root.is_dir():
        return []
    found = [(int(d.name[5:]), d) for d in root.iterdir()
             if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / STATE_FILE).is_file()]
    return [d for _, d in sorted(found)]


def latest_sharded(run_dir: str | Path) -> Path | None:
    found = list_sharded(run_dir)
    return found[-1] if found else None
