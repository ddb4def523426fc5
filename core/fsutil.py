"""Atomic file writes: a reader sees the old file or the new one, never half of either. Files are
written with the mode a plain open() would give them (0666 less the process's umask: 0644
under the usual 022), as every other run file is."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator


def file_mode() -> int:
    """The mode a plain open() gives a new file: 0666 less the process's umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_writer(path) as f:
        f.write(data)
    return Path(path)


@contextlib.contextmanager
def atomic_writer(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file to write `path` through piece by piece; it replaces `path` (fsynced) only when
    the block ends without an error, and is removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())  # mkstemp's own 0600 would differ from the other run files
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # any failure, Ctrl-C included: the temp file goes and the error goes on
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def json_text(obj: Any) -> str:
    """The JSON text atomic_write_json writes."""
    return json.dumps(obj, indent=2, sort_keys=True, default=float) + "\n"


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json_text(obj))


def json_safe(x: Any) -> Any:
    """JSON-safe: numpy to Python, NaN/inf to null (strict JSON has no NaN)."""
    import math

    import numpy as np

    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x
