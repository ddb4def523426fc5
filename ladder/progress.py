"""Progress of a sweep: workers report to a small Ray actor on the driver's node, the driver
drains it and draws one rich display (a bar per run and an overall bar).

An actor rather than a streaming generator: a retried generator task must replay the same number
of items, which a run resumed from a checkpoint does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

_SINK_CLASS = None


def progress_sink():
    """A ProgressSink actor pinned to the driver's node (so losing a worker node keeps it)."""
    global _SINK_CLASS
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if _SINK_CLASS is None:

        class ProgressSink:
            def __init__(self):
                self._latest: dict[str, dict] = {}

            def report(self, key: str, update: dict) -> None:
                self._latest[key] = update

            def drain(self) -> dict[str, dict]:
                out, self._latest = self._latest, {}
                return out

        _SINK_CLASS = ray.remote(num_cpus=0, max_restarts=-1)(ProgressSink)
    here = ray.get_runtime_context().get_node_id()
    return _SINK_CLASS.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()


class Reporter:
    """Worker side: throttled, fire-and-forget reports (a lost report only delays the bar)."""

    def __init__(self, sink: Any, key: str, every_s: float = 0.5):
        self.sink, self.key, self.every_s = sink, key, every_s
        self._last = 0.0

    def __call__(self, update: dict, force: bool = False) -> None:
        now = time.monotonic()
        if self.sink is None or (not force and now - self._last < self.every_s):
            return
        self._last = now
        import ray  # the worker's Ray, loaded already (the CLI, which imports this module, does not load it)

        try:
            self.sink.report.remote(self.key, update)
        except ray.exceptions.RayError:  # the sink actor gone (fire-and-forget: a lost report only delays the bar)
            pass


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


@dataclass
class _Row:
    name: str
    total: int
    task: TaskID | None = None
    step: int = 0
    state: str = "queued"
    extra: dict = field(default_factory=dict)


class SweepDisplay:
    """Live bars on a terminal; one line per event otherwise (logs, CI, tests)."""

    def __init__(self, runs: list[tuple[str, str, int]], console: Console | None = None, enabled: bool = True):
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self.rows = {key: _Row(name, total) for key, name, total in runs}
        self._n_done = 0
        self._progress = Progress(
            TextColumn("{task.description:<18}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
            refresh_per_second=4,
        )
        total_steps = sum(r.total for r in self.rows.values())
        self._overall = self._progress.add_task(self._overall_text(), total=total_steps, info="")
        for key, row in self.rows.items():
            row.task = self._progress.add_task(row.name, total=row.total, info="queued", visible=True)

    def _overall_text(self) -> str:
        return f"all ({self._n_done}/{len(self.rows)} runs)"

    def __enter__(self) -> "SweepDisplay":
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def log(self, msg: str) -> None:
        if self.enabled:
            self.console.print(msg, highlight=False)

    def update(self, key: str, upd: dict) -> None:
        row = self.rows.get(key)
        if row is None or row.state not in ("queued", "running"):
            return  # a late report of a run already done
        if row.state == "queued":
            row.state = "running"
            if not self.live:
                self.log(f"{row.name}: running on {upd.get('host', '?')} (pid {upd.get('pid', '?')}) from step {upd.get('step', 0)}")
        row.step = int(upd.get("step", row.step))
        info = f"loss {_fmt(upd.get('loss'), '.4f')}  {_fmt(upd.get('tokens_per_s'), ',.0f')} tok/s"
        self._progress.update(row.task, completed=row.step, info=info)
        self._progress.update(self._overall, completed=sum(r.step for r in self.rows.values()))

    def done(self, key: str, outcome: str, note: str = "") -> None:
        row = self.rows.get(key)
        if row is None:
            return
        row.state = outcome
        if outcome in ("finished", "skipped"):
            row.step = row.total
        self._n_done += 1
        self._progress.update(row.task, completed=row.step, info=f"{outcome} {note}".strip())
        self._progress.update(
            self._overall, completed=sum(r.step for r in self.rows.values()), description=self._overall_text()
        )
        if not self.live:
            self.log(f"{row.name}: {outcome} {note}".strip())

    def waiting(self, key: str, note: str) -> None:
        row = self.rows.get(key)
        if row is not None:
            self._progress.update(row.task, info=note)
            if not self.live:
                self.log(f"{row.name}: {note}")
