"""The run directory: the one owner of its file names and formats.

    run_dir/
        spec.yaml        the spec the run trains (rewritten only when its text changes)
        metrics.jsonl    one JSON record per step, appended and flushed as made: the source of truth
        status.json      {"state": pending | running | finished | diverged | failed, ...}
        checkpoints/     step-NNNNNNNN/ directories, written by the engine

Readers of metrics.jsonl never fail on a bad line: a torn last line (a killed writer) is skipped
silently; any other line that is not a JSON object (bad bytes, a corrupt record mid-file) is skipped
with one warning naming the file and the line number.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from core.fsutil import atomic_write_json, atomic_write_text, json_text

SPEC_FILE = "spec.yaml"
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
CHECKPOINTS_DIR = "checkpoints"

Warn = Callable[[str], None]
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, an exhausted quota


_warned: set[str] = set()


def _stderr(msg: str) -> None:
    """One warning line on stderr, once per process (a command may read a file twice)."""
    if msg not in _warned:
        _warned.add(msg)
        print(f"warning: {msg}", file=sys.stderr)


def parse_metrics_lines(raw: bytes, path: Path | str, warn: Warn | None = _stderr,
                        first_line: int = 1, torn_tail_ok: bool = True) -> list[dict]:
    """Records of metrics.jsonl bytes. Bad lines are skipped; each one but a torn final line is
    reported through `warn` with the file and line number."""
    lines = raw.split(b"\n")
    has_newline_end = raw.endswith(b"\n")
    if has_newline_end:
        lines = lines[:-1]
    out: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line.decode("utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as err:
            last = i == len(lines) - 1 and not has_newline_end
            if not (last and torn_tail_ok) and warn is not None:
                why = "not UTF-8" if isinstance(err, UnicodeDecodeError) else "not a JSON record"
                warn(f"{path}:{first_line + i}: skipped a bad metrics line ({why})")
            continue
        out.append(rec)
    return out


class RunDir:
    """One run's directory. Cheap to make; touches the disk only when asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ---- paths ---------------------------------------------------------------------------
    @property
    def spec_path(self) -> Path:
        return self.path / SPEC_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    # ---- spec.yaml -----------------------------------------------------------------------
    def write_spec_text(self, text: str) -> None:
        if not self.spec_path.exists() or self.spec_path.read_text() != text:
            atomic_write_text(self.spec_path, text)

    # ---- status.json ---------------------------------------------------------------------
    def read_status(self) -> dict:
        try:
            st = json.loads(self.status_path.read_text())
        except FileNotFoundError:
            return {"state": "pending"}
        except (OSError, UnicodeDecodeError, ValueError):
            _stderr(f"{self.status_path}: unreadable status, treated as failed")
            return {"state": "failed", "error": "unreadable status.json"}
        return st if isinstance(st, dict) else {"state": "failed", "error": "status.json is not an object"}

    def write_status(self, state: str, **info: Any) -> None:
        """state: running | finished | diverged | failed. Atomic; on a full disk, where the new file
        finds no room, the old one is rewritten in place (a status that says "running" of a run that
        stopped would be worse than the small chance of a torn one, which readers treat as failed).
        An error names status.json."""
        doc = {"state": state, **info}
        try:
            atomic_write_json(self.status_path, doc)
        except OSError as e:
            if e.errno not in NO_SPACE or not self.status_path.exists():
                raise OSError(e.errno, e.strerror, str(self.status_path)) from None
            try:
                with open(self.status_path, "r+b") as f:
                    f.truncate(0)  # its blocks freed first: the same room takes the new text
                    f.write(json_text(doc).encode())
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as again:
                raise OSError(again.errno, again.strerror, str(self.status_path)) from None

    # ---- metrics.jsonl -------------------------------------------------------------------
    def read_metrics(self, warn: Warn | None = _stderr) -> list[dict]:
        try:
            raw = self.metrics_path.read_bytes()
        except FileNotFoundError:
            return []
        return parse_metrics_lines(raw, self.metrics_path, warn)

    def metrics_rows(self) -> int:
        return len(self.read_metrics(warn=None))

    def last_metrics(self, chunk: int = 16384, warn: Warn | None = _stderr) -> dict | None:
        """The last complete record, read from the file's end (cheap on long runs). Bad lines
        passed over on the way are reported like read_metrics does (file:line), a torn last one not."""
        try:
            with open(self.metrics_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                back = min(size, chunk)
                while True:
                    start = size - back
                    f.seek(start)
                    lines = f.read(back).split(b"\n")
                    first = 1 if back < size else 0  # a chunk's first line may begin mid-record
                    for k in range(len(lines) - 1, first - 1, -1):
                        raw = lines[k]
                        if not raw.strip():
                            continue
                        torn = k == len(lines) - 1  # no newline after it: a writer may still be on it
                        got = parse_metrics_lines(raw + (b"" if torn else b"\n"), self.metrics_path, warn=None)
                        if got:
                            return got[0]
                        if not torn and warn is not None:
                            f.seek(0)
                            parse_metrics_lines(raw + b"\n", self.metrics_path, warn,
                                                first_line=f.read(start).count(b"\n") + k + 1)
                    if back >= size:
                        return None
                    back = min(size, back * 4)
        except FileNotFoundError:
            return None

    def truncate_metrics(self, keep_below_step: int) -> None:
        """Keep only complete records with step < keep_below_step. A file with no record at or past
        that step that ends with a whole line is left as it is, damaged lines and all (a finished
        run trained again loses nothing); otherwise it is rewritten from its good records below the
        step (bad lines are dropped, and a torn last line never has a record appended to it)."""
        try:
            raw = self.metrics_path.read_bytes()
        except FileNotFoundError:
            return
        records = parse_metrics_lines(raw, self.metrics_path, _stderr)
        kept = [r for r in records if _step(r) < keep_below_step]
        if len(kept) == len(records) and raw[-1:] in (b"", b"\n"):
            return
        atomic_write_text(self.metrics_path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))

    def check_writable(self) -> None:
        """OSError naming the path unless a run can write here: the directory (or, while it is
        missing, the nearest directory above it, where it would be made) takes a new file, and
        metrics.jsonl, if there, can be appended to. Leaves nothing behind, not even the directory."""
        d = self.path
        while not d.exists() and d.parent != d:
            d = d.parent
        try:
            with tempfile.TemporaryFile(dir=d):
                pass
        except OSError as e:  # (its filename is the probe's, not the directory's)
            raise OSError(e.errno, e.strerror, str(d)) from None
        if self.metrics_path.exists():
            open(self.metrics_path, "ab").close()

    def metrics_writer(self, resume_step: int) -> "MetricsWriter":
        return MetricsWriter(self, resume_step)


def _step(rec: dict) -> float:
    s = rec.get("step")
    return s if isinstance(s, (int, float)) and not isinstance(s, bool) else math.inf


class MetricsWriter:
    """Appends records to metrics.jsonl, each in one write of its own (no buffer). On resume,
    records at or past the resume step are dropped first, so the file never holds a step twice.
    A record that cannot be written whole (a full disk) is taken back off the file, so it ends
    with the last whole record, and the OSError names the file."""

    def __init__(self, run: RunDir | str | Path, resume_step: int):
        self.run = run if isinstance(run, RunDir) else RunDir(run)
        self.path = self.run.metrics_path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run.truncate_metrics(resume_step)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode()
        end = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, end)  # no torn record left behind
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def write(self, record: Any) -> None:
        self.write_line(record.to_json() if hasattr(record, "to_json") else json.dumps(record, allow_nan=True))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def iter_run_dirs(root: str | Path) -> Iterator[RunDir]:
    """Run directories (those holding a spec.yaml) under root, sorted."""
    root = Path(root)
    if not root.is_dir():
        return
    for p in sorted(root.rglob(SPEC_FILE)):
        yield RunDir(p.parent)
