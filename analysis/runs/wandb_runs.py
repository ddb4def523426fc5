"""W&B runs as metric sources: a run directory the `wandb` library writes (offline, or beside an
online run), read while it grows, or a run on a W&B server through wandb's public API.

    src = open_wandb("wandb:/path/to/wandb/offline-run-20260101_120000-abc123", names=load_metric_names("olmo-core"))
    df = src.read()          # every history row so far
    df = src.read()          # again: only the records appended since are parsed
    src.status()             # {"state": "running" | "finished" | "failed"}

    src = open_wandb("wandb:ENTITY/PROJECT/RUN_ID")   # a W&B server (WANDB_API_KEY, WANDB_BASE_URL)

The run directory's `run-<id>.wandb` file is wandb's transaction log: LevelDB's log format
(32 KiB blocks of records, each `crc32 (seeded with the record type) | length | type` then data,
FULL or FIRST/MIDDLE.../LAST) after a 7-byte `:W&B` header, each assembled record one
`wandb_internal_pb2.Record` protobuf. `wandb` writes it from its service process (wandb-core); the
Python reader that wandb shipped for it (wandb/sdk/internal/datastore.py, `DataStore.scan_data`)
left the library with the legacy service, so the log format is read here the same way and every
record is decoded by wandb's own protobuf classes (`wandb.proto.wandb_internal_pb2`). A record
still being written (the file ends inside it) is left for the next read. History rows carry
`_step` (the step given to `run.log(..., step=)`), `_timestamp` and `_runtime`; a run record
carries the run's id, project and config; an exit record its exit code.

A server run is read with `wandb.Api().run(path).scan_history(min_step=...)`, the public API's
paged history, asking only for the steps past the last one read.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.runs.names import ALIASES, MetricNames, matches
from analysis.runs.metrics import MetricsError, finish_frame
from core.safeload import parse_json

__all__ = ["WANDB_PREFIX", "WandbApiSource", "WandbDirSource", "open_wandb", "read_log_records", "resolve_wandb_log"]

WANDB_PREFIX = "wandb:"

# LevelDB log format with W&B's header (wandb/sdk/internal/datastore.py in wandb <= 0.2x)
HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
HEADER_IDENT, HEADER_MAGIC, HEADER_VERSION = b":W&B", 0xBEE1, 0
RECORD = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CRC = {t: zlib.crc32(bytes([t])) & 0xFFFFFFFF for t in (FULL, FIRST, MIDDLE, LAST)}

# keys wandb adds to every history row
_INTERNAL = ("_step", "_timestamp", "_runtime")
API_STATE = {"running": "running", "pending": "running", "finished": "finished", "failed": "failed",
             "crashed": "failed", "killed": "interrupted", "preempted": "interrupted"}


def read_log_records(path: Path, offset: int = 0) -> tuple[list[bytes], int]:
    """The complete records of a .wandb log from byte `offset` (0: after checking the header), and
    the offset to read from next (the start of the first record not yet complete). Only the bytes
    from `offset` on are read."""
    with open(path, "rb") as f:
        if offset == 0:
            head = f.read(HEADER.size)
            if len(head) < HEADER.size:
                return [], 0
            ident, magic, version = HEADER.unpack(head)
            if ident != HEADER_IDENT or magic != HEADER_MAGIC:
                raise MetricsError(f"{path}: not a W&B run log (no :W&B header)")
            if version != HEADER_VERSION:
                raise MetricsError(f"{path}: W&B log version {version}, this reader knows version {HEADER_VERSION}")
            offset = HEADER.size
        f.seek(offset)
        data = f.read()
    end = offset + len(data)  # positions below are the file's; data[i - offset] is byte i
    out: list[bytes] = []
    pos, start, parts = offset, offset, []
    while True:
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # the block's trailer is zero padding
            pad = data[pos - offset: pos - offset + left]
            if pad.strip(b"\0"):
                raise MetricsError(f"{path}: corrupt block trailer at byte {pos} (not zero padding)")
            pos += left
            left = BLOCK
        if pos + RECORD.size > end:
            break
        crc, length, kind = RECORD.unpack_from(data, pos - offset)
        if RECORD.size + length > left:  # a record never crosses its block: the header is damaged
            raise MetricsError(f"{path}: corrupt record at byte {pos} (length {length} crosses its block)")
        body = data[pos - offset + RECORD.size: pos - offset + RECORD.size + length]
        if len(body) < length:
            break  # being written
        if kind not in _CRC or zlib.crc32(body, _CRC[kind]) & 0xFFFFFFFF != crc:
            if pos + RECORD.size + length == end:
                break  # the file's last record, torn: the writer has not finished it
            raise MetricsError(f"{path}: corrupt record at byte {pos} (bad checksum or type {kind})")
        pos += RECORD.size + length
        if kind == FULL:
            out.append(body)
            start, parts = pos, []
        elif kind == FIRST:
            parts = [body]
        else:
            if not parts:
                raise MetricsError(f"{path}: record part of type {kind} at byte {pos} without its first part")
            parts.append(body)
            if kind == LAST:
                out.append(b"".join(parts))
                start, parts = pos, []
    return out, start


def resolve_wandb_log(path: str | Path) -> Path:
    """A run's .wandb file from itself, its run directory (run-*/ or offline-run-*/), or a `wandb/`
    directory (its latest-run)."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".wandb":
            raise MetricsError(f"{p}: not a W&B run log (expected run-<id>.wandb)")
        return p.resolve()
    if not p.is_dir():
        raise MetricsError(f"{p}: no such W&B run directory")
    for d in (p, p / "latest-run", p / "wandb" / "latest-run"):
        logs = sorted(d.glob("run-*.wandb")) if d.is_dir() else []
        if len(logs) == 1:
            return logs[0].resolve()  # latest-run is a link: a follower stays on this run
        if len(logs) > 1:
            raise MetricsError(f"{d}: several run logs ({', '.join(x.name for x in logs)}); name one")
    runs = sorted(x.name for x in p.glob("*run-*") if x.is_dir())
    raise MetricsError(f"{p}: no run-<id>.wandb here" + (f" (runs: {', '.join(runs[:5])})" if runs else
                                                          " (give the run directory wandb wrote)"))


def _value(text: str) -> float | None:
    if text.lstrip()[:1] in ("[", "{"):
        return None  # media, histograms, tables: not a curve (and not decoded: it may nest arbitrarily)
    try:
        v = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None  # media, histograms, tables: not a curve
    return float(v)


def _loss_patterns(names: MetricNames | None, columns: dict[str, str] | None) -> list[str]:
    if names is not None and "loss" in names.entries:
        return list(names.entries["loss"].names)
    if columns and "loss" in columns:
        return [columns["loss"]]
    return []


def _is_loss(key: str, patterns: list[str]) -> bool:
    if patterns:
        return any(matches(key, p) for p in patterns)
    return key.lower() in ALIASES["loss"]


@dataclass
class _History:
    """History rows by step, kept across reads (a step logged again keeps its last values)."""

    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    loss_steps: set[int] = field(default_factory=set)

    def add(self, step: int, values: dict[str, float], loss_patterns: list[str]) -> None:
        self.rows.setdefault(step, {}).update(values)
        if any(_is_loss(k, loss_patterns) for k in values):
            self.loss_steps.add(step)

    def frame(self, label: str, names: MetricNames | None, columns: dict[str, str] | None) -> pd.DataFrame:
        if not self.rows:
            raise MetricsError(f"{label}: no metric records")
        steps = sorted(self.loss_steps or self.rows)
        keys = sorted({k for s in steps for k in self.rows[s]})
        wide = pd.DataFrame({"step": np.asarray(steps, dtype=np.int64)})
        for k in keys:
            if k in _INTERNAL:
                continue
            wide[k] = [self.rows[s].get(k, np.nan) for s in steps]
        wide["time"] = [self.rows[s].get("_timestamp", np.nan) for s in steps]
        return finish_frame(wide, label, columns, names)


@dataclass
class WandbDirSource:
    """A run directory the wandb library writes; each read parses only the records appended since."""

    path: Path
    names: MetricNames | None = None
    columns: dict[str, str] | None = None
    records_read: int = 0
    config: dict = field(default_factory=dict)
    run_id: str | None = None
    project: str | None = None
    exit_code: int | None = None
    _offset: int = 0
    _history: _History = field(default_factory=_History)

    def __post_init__(self) -> None:
        try:
            from google.protobuf.message import DecodeError  # wandb's dependency
            from wandb.proto import wandb_internal_pb2  # wandb's own record schema
        except ImportError:
            raise MetricsError(f"{self.label}: reading W&B runs needs the wandb package: "
                               "pip install 'moe-ladder[wandb]'") from None
        self._pb, self._decode_error = wandb_internal_pb2, DecodeError
        self.log = resolve_wandb_log(self.path)

    @property
    def label(self) -> str:
        return f"{WANDB_PREFIX}{self.path}"

    def _scan(self) -> None:
        raws, self._offset = read_log_records(self.log, self._offset)
        loss_patterns = _loss_patterns(self.names, self.columns)
        for raw in raws:
            rec = self._pb.Record()
            try:
                rec.ParseFromString(raw)
            except self._decode_error as e:
                raise MetricsError(f"{self.log}: record {self.records_read + 1} is not a W&B record ({e})") from None
            self.records_read += 1
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                values: dict[str, float] = {}
                for item in rec.history.item:
                    key = ".".join(item.nested_key) if item.nested_key else item.key
                    v = _value(item.value_json)
                    if v is not None:
                        values[key] = v
                step = rec.history.step.num if rec.history.HasField("step") else values.get("_step")
                if step is None or not math.isfinite(step):
                    continue
                self._history.add(int(step), values, loss_patterns)
            elif kind == "run":
                self.run_id, self.project = rec.run.run_id, rec.run.project
                for item in rec.run.config.update:
                    key = ".".join(item.nested_key) if item.nested_key else item.key
                    try:
                        self.config[key] = parse_json(item.value_json, f"{self.log}: config {key}")
                    except json.JSONDecodeError:
                        self.config[key] = item.value_json
            elif kind == "exit":
                self.exit_code = int(rec.exit.exit_code)

    def read(self) -> pd.DataFrame:
        self._scan()
        return self._history.frame(self.label, self.names, self.columns)

    def read_config(self) -> dict:
        """The run's config as logged so far (no history needed)."""
        self._scan()
        return self.config

    def status(self) -> dict:
        if self.exit_code is None:
            return {"state": "running"}
        return {"state": "finished" if self.exit_code == 0 else "failed", "exit_code": self.exit_code}

    spec: Any = None
    run_dir: Path | None = None

    def checkpoint_steps(self) -> list[int]:
        return []

    def describe(self) -> dict:
        return {"kind": "wandb-dir", "log": str(self.log), "run_id": self.run_id, "project": self.project,
                "records_read": self.records_read, "metric_names": self.names.label if self.names else None}


@dataclass
class WandbApiSource:
    """A run on a W&B server, read through wandb's public API (`wandb.Api`); each read asks for the
    steps after the last one read."""

    path: str
    names: MetricNames | None = None
    columns: dict[str, str] | None = None
    page_size: int = 1000
    rows_fetched: int = 0
    _last_step: int = -1
    _history: _History = field(default_factory=_History)

    def __post_init__(self) -> None:
        try:
            import wandb
        except ImportError:
            raise MetricsError(f"{self.label}: reading W&B runs needs the wandb package: "
                               "pip install 'moe-ladder[wandb]'") from None
        # wandb's own errors (CommError, no API key: UsageError), requests' network errors (OSError)
        self._api_errors = (wandb.errors.Error, OSError)
        try:
            self.api = wandb.Api(timeout=30)
            self._run = self.api.run(self.path)
        except (*self._api_errors, ValueError) as e:  # ValueError: no such run (RunNotFoundError), a malformed path
            raise MetricsError(f"{self.label}: cannot read the run from W&B ({_first_line(e)})") from None
        self.config = dict(self._run.config or {})

    @property
    def label(self) -> str:
        return f"{WANDB_PREFIX}{self.path}"

    def read(self) -> pd.DataFrame:
        loss_patterns = _loss_patterns(self.names, self.columns)
        try:
            self._run.load(force=True)
            for row in self._run.scan_history(page_size=self.page_size, min_step=self._last_step + 1):
                step = row.get("_step")
                if step is None:
                    continue
                values = {k: float(v) for k, v in row.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
                self._history.add(int(step), values, loss_patterns)
                self._last_step = max(self._last_step, int(step))
                self.rows_fetched += 1
        except MetricsError:
            raise
        except self._api_errors as e:  # the server went away mid-watch: keep what was read
            raise MetricsError(f"{self.label}: reading from W&B failed ({_first_line(e)})") from None
        return self._history.frame(self.label, self.names, self.columns)

    def status(self) -> dict:
        state = str(getattr(self._run, "state", "") or "")
        return {"state": API_STATE.get(state, state or "unknown"), "wandb_state": state}

    spec: Any = None
    run_dir: Path | None = None

    def checkpoint_steps(self) -> list[int]:
        return []

    def describe(self) -> dict:
        return {"kind": "wandb", "path": self.path, "rows_fetched": self.rows_fetched,
                "metric_names": self.names.label if self.names else None}


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def open_wandb(run: str, names: MetricNames | None = None,
               columns: dict[str, str] | None = None) -> WandbDirSource | WandbApiSource:
    """`wandb:DIR` (a run directory on this machine: read from its log) or `wandb:ENTITY/PROJECT/RUN_ID`
    (a run on a W&B server: the public API)."""
    target = run[len(WANDB_PREFIX):].strip() if run.startswith(WANDB_PREFIX) else run.strip()
    if not target:
        raise MetricsError(f"{run!r}: name the run, wandb:DIR or wandb:ENTITY/PROJECT/RUN_ID")
    p = Path(target).expanduser()
    parts = target.split("/")
    local = p.exists() or target.startswith(("/", ".", "~")) or target.endswith(".wandb") or \
        any(x == "wandb" or x == "latest-run" or "run-" in x for x in parts)
    if local or len(parts) != 3:
        return WandbDirSource(p, names, columns)  # a directory, perhaps not written yet (--follow waits)
    return WandbApiSource(target, names, columns)
