"""Data checks made before any run starts: no spec may read a source more than data.max_epochs times."""

from __future__ import annotations

from engines.epochs import repeats
from ladder.errors import LadderError
from ladder.experiment import load_experiment


def refuse_repeats(experiment: str, only: str | None = None, include_hero: bool = False) -> None:
    """LadderError (one line, exit 2) naming the first selected spec that would repeat a source."""
    for spec in load_experiment(experiment).select(only, include_hero):
        over = repeats(spec)
        if over:
            worst = ", ".join(f"{n} {x:.2f} epochs" for n, x in sorted(over.items()))
            raise LadderError(f"{spec.name}: reads {worst}, more than data.max_epochs {spec.data.max_epochs:g}; "
                              "add data, shorten the run, or allow repeats with data.max_epochs")
