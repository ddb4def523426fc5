"""replan.json: a replan as `ladder replan` writes it beside the option specs (the run where it
stands, the deadline, the monitor's flags, one row per option, the recommendation), read by the
report.

    doc = plan.document()                        # ReplanDoc (analysis.replan.state.Replan)
    write_replan_json("replan.json", doc); doc = read_replan("replan.json")
    doc.options[0].forecast_loss, doc.recommendation

Every problem reading one raises ReplanFileError (an InputError: one line, exit 2) naming the file
and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from analysis.monitor.flags import Flag
from core.errors import InputError
from core.fsutil import atomic_write_text
from core.safeload import kind_error, read_document

__all__ = ["OptionRow", "ReplanDoc", "ReplanFileError", "read_replan", "write_replan_json"]

_NUM = (int, float)
_NONE = type(None)


class ReplanFileError(InputError):
    """A replan.json that cannot be read."""


def _check(kinds: dict[str, tuple[type, ...]], d: dict, where: str, path: str | Path) -> None:
    for k, kind in kinds.items():
        if (wrong := kind_error(d.get(k), kind)) is not None:
            raise ReplanFileError(f"{path}: replan {where}{k} {wrong}")


@dataclass(frozen=True)
class OptionRow:
    """One option of a replan as its table row and replan.json's `options` hold it: what it does,
    where it resumes, when it would finish and at what cost, and its forecast final loss."""

    n: int
    kind: str
    title: str
    allowed: bool
    spec_id: str | None = None
    spec_path: str | None = None
    resume_step: int | None = None
    resume_run_dir: str | None = None
    resume_checkpoint: str | None = None
    total_steps: int | None = None
    tokens: float | None = None
    finish: str | None = None
    meets_deadline: bool | None = None
    device_hours: float | None = None
    forecast_loss: float | None = None
    forecast_lo: float | None = None
    forecast_hi: float | None = None
    forecast_level: float | None = None
    memory_gb: float | None = None
    reason: str | None = None
    note: str | None = None

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "n": (int,), "kind": (str,), "title": (str,), "allowed": (bool,), "spec_id": (str, _NONE),
        "spec_path": (str, _NONE), "resume_step": (int, _NONE), "resume_run_dir": (str, _NONE),
        "resume_checkpoint": (str, _NONE), "total_steps": (int, _NONE), "tokens": (*_NUM, _NONE),
        "finish": (str, _NONE), "meets_deadline": (bool, _NONE), "device_hours": (*_NUM, _NONE),
        "forecast_loss": (*_NUM, _NONE), "forecast_lo": (*_NUM, _NONE), "forecast_hi": (*_NUM, _NONE),
        "forecast_level": (*_NUM, _NONE), "memory_gb": (*_NUM, _NONE), "reason": (str, _NONE), "note": (str, _NONE)}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "replan.json", where: str = "options[0].") -> OptionRow:
        if not isinstance(d, dict):
            raise ReplanFileError(f"{path}: replan {where[:-1]} is {type(d).__name__}, not a mapping")
        _check(cls.KINDS, d, where, path)
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ReplanDoc:
    """replan.json's document: the run where it stands, the time and the deadline (ISO, UTC), the
    monitor's flags, the options, the recommended one (1-based) and why, the gate of the next
    context stage and notes."""

    run: dict[str, Any]
    now: str
    deadline: str | None
    flags: tuple[Flag, ...]
    options: tuple[OptionRow, ...]
    recommended: int | None
    recommendation: str
    context_gate: dict[str, Any] | None
    notes: list[str]

    KINDS: ClassVar[dict[str, tuple[type, ...]]] = {
        "run": (dict,), "now": (str,), "deadline": (str, _NONE), "flags": (list,), "options": (list,),
        "recommended": (int, _NONE), "recommendation": (str,), "context_gate": (dict, _NONE), "notes": (list,)}

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "now": self.now, "deadline": self.deadline, "flags": [f.to_dict() for f in self.flags],
                "options": [o.to_dict() for o in self.options], "recommended": self.recommended,
                "recommendation": self.recommendation, "context_gate": self.context_gate, "notes": self.notes}

    def text(self) -> str:
        """The JSON text of replan.json."""
        return json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n"

    @classmethod
    def from_dict(cls, d: Any, path: str | Path = "replan.json") -> ReplanDoc:
        """ReplanFileError naming the file and the field when `d` is not a replan."""
        if not isinstance(d, dict):
            raise ReplanFileError(f"{path}: expected a JSON object, found a {type(d).__name__}; rerun the command that writes it")
        _check(cls.KINDS, d, "", path)
        try:
            flags = tuple(Flag.from_dict(f, f"replan flags[{i}]") for i, f in enumerate(d["flags"]))
        except InputError as e:
            raise ReplanFileError(f"{path}: {e}") from None
        options = tuple(OptionRow.from_dict(o, path, f"options[{i}].") for i, o in enumerate(d["options"]))
        return cls(d["run"], d["now"], d["deadline"], flags, options, d["recommended"], d["recommendation"],
                   d["context_gate"], d["notes"])


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


def write_replan_json(path: str | Path, doc: ReplanDoc) -> Path:
    """replan.json, written atomically (core.fsutil)."""
    return atomic_write_text(path, doc.text())


def read_replan(path: str | Path) -> ReplanDoc | None:
    """replan.json as the ReplanDoc that wrote it (within core.safeload's limits), None when absent;
    ReplanFileError naming the file and the problem otherwise."""
    data = read_document(path, ReplanFileError)
    return None if data is None else ReplanDoc.from_dict(data, Path(path))
