"""compare.json: a run against its forecast as `ladder compare --json` prints it (the run, where its
metrics came from, the monitor's flags, summary and settings), written by `ladder demo` beside the
forecast and read by the report.

    c = Comparison.of(label, source.describe(), report, png)   # from a monitor report
    write_comparison("compare.json", c); c = read_comparison("compare.json")
    c.flags                                                   # [Flag], c.worst: the worst severity

Every problem reading one raises ComparisonError (an InputError: one line, exit 2) naming the file
and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.monitor.flags import SEVERITY_RANK, Flag, MonitorReport
from core.errors import InputError
from core.fsutil import atomic_write_text
from core.safeload import kind_error, read_document

__all__ = ["Comparison", "ComparisonError", "read_comparison", "write_comparison"]


class ComparisonError(InputError):
    """A compare.json that cannot be read."""


@dataclass(frozen=True)
class Comparison:
    """One `ladder compare` of a run against its forecast: compare.json's document."""

    run: str
    source: dict[str, Any]
    worst: str | None
    flags: tuple[Flag, ...]
    summary: dict[str, Any]
    settings: dict[str, Any]
    metrics: str | None = None  # the metrics file, when the run was read from one
    png: str | None = None  # the plot `--png` wrote

    @classmethod
    def of(cls, run: str, source: dict[str, Any], report: MonitorReport, png: str | None = None) -> Comparison:
        return cls(run, source, report.worst, tuple(report.flags), report.summary, report.settings,
                   metrics=source.get("metrics"), png=png)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, **({"metrics": self.metrics} if self.metrics is not None else {}),
                "source": self.source, "worst": self.worst, "flags": [f.to_dict() for f in self.flags],
                "summary": self.summary, "settings": self.settings, **({"png": self.png} if self.png is not None else {})}

    def text(self) -> str:
        """The JSON text of compare.json (and of `ladder compare --json`)."""
        return json.dumps(self.to_dict(), indent=2, default=str)

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "compare.json") -> Comparison:
        """ComparisonError naming the file and the field when `d` is not a comparison."""
        if not isinstance(d, dict):
            raise ComparisonError(f"{path}: expected a JSON object, found a {type(d).__name__}; rerun the command that writes it")
        kinds = {"run": (str,), "source": (dict,), "worst": (str, type(None)), "flags": (list,), "summary": (dict,),
                 "settings": (dict,), "metrics": (str, type(None)), "png": (str, type(None))}
        for k, kind in kinds.items():
            if (wrong := kind_error(d.get(k), kind)) is not None:
                raise ComparisonError(f"{path}: compare {k} {wrong}")
        if d["worst"] is not None and d["worst"] not in SEVERITY_RANK:
            raise ComparisonError(f"{path}: compare worst is {d['worst']!r}, not one of {', '.join(SEVERITY_RANK)}")
        try:
            flags = tuple(Flag.from_dict(f, f"compare flags[{i}]") for i, f in enumerate(d["flags"]))
        except InputError as e:
            raise ComparisonError(f"{path}: {e}") from None
        return cls(d["run"], d["source"], d["worst"], flags, d["summary"], d["settings"], metrics=d.get("metrics"),
                   png=d.get("png"))


def write_comparison(path: str | Path, c: Comparison) -> Path:
    """compare.json, written atomically (core.fsutil)."""
    return atomic_write_text(path, c.text())


def read_comparison(path: str | Path) -> Comparison | None:
    """compare.json as the Comparison that wrote it (within core.safeload's limits), None when
    absent; ComparisonError naming the file and the problem otherwise."""
    data = read_document(path, ComparisonError)
    return None if data is None else Comparison.from_dict(data, Path(path))
