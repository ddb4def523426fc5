"""The documents of one data source: which files, in which order, and how each is read.

    files = source_files(source)                 # [(document name, path)] in the source's order
    docs = read_docs(source, name, path)         # [(document name, bytes)] of one file
    for name, pieces in iter_docs(source, name, path):   # the same, streamed (bounded memory)

Builtins. `python_code` is the Python installation's own standard library source (sysconfig
stdlib dir, *.py, without site-packages / dist-packages / test directories, so a fresh venv of
the same Python reads the same files), capped at BUILTIN_CODE_CAP bytes. `python_docs` is prose
the same installation ships: the reference manual in pydoc_data/topics.py (one document per
topic) and the stdlib's *.txt / *.rst / *.md / README* / LICENSE* files. Builtin files are
ordered by a hash of their name, so the held-out tail is a spread of documents, not the alphabet's
end. `packages_python`, `packages_docs` and `packages_native` are the three parts of the corpus
`ladder data corpus` (engines.corpus) builds from installed packages, read from
$MOE_LADDER_CORPUS (default ~/.cache/moe-ladder/corpus)/<part>/*.jsonl in file order.

User files. `paths:` are files or globs (~ expanded, sorted): .txt .text .md .rst .py are read as
raw bytes, .jsonl / .ndjson take each line's `text_key` field, .parquet the `text_key` column.

Streaming. iter_docs reads a file as it goes (a line of jsonl, a row batch of parquet at a time)
and hands a raw-bytes document over in pieces of about PIECE_BYTES, each cut just after a newline
that has a non-space character on either side (a document with no such newline stays one piece),
so no file is ever held in memory whole.

Errors raise DataError (a ValueError) naming the source and the file.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from core import env
from core.errors import InputError
from core.spec import SourceSpec

BUILTIN_CODE_CAP = 16 * 2**20
PIECE_BYTES = 2**20
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
PACKAGE_PARTS = {"packages_python": "python", "packages_docs": "docs", "packages_native": "native"}
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class DataError(InputError):
    """A data source that cannot be read; the message names the source."""


def cache_dir() -> Path:
    return env.path("CACHE") or Path.home() / ".cache" / "moe-ladder"


def corpus_dir() -> Path:
    return env.path("CORPUS") or cache_dir() / "corpus"


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])  # in a venv this already points into the base installation


def _walk(root: Path, want) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames) if want(f)]
    return out


def hash_order(named: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
    return sorted(named, key=lambda kv: (hashlib.sha1(kv[0].encode()).hexdigest(), kv[0]))


def _python_code_files() -> list[tuple[str, Path]]:
    root = _stdlib_dir()
    chosen, total = [], 0
    for rel, path in hash_order((str(p.relative_to(root)), p) for p in _walk(root, lambda f: f.endswith(".py"))):
        if total >= BUILTIN_CODE_CAP:
            break
        chosen.append((rel, path))
        total += path.stat().st_size
    return chosen


def _is_prose_file(name: str) -> bool:
    return name.endswith((".txt", ".rst", ".md")) or name.startswith(("README", "LICENSE"))


def _python_docs_files() -> list[tuple[str, Path]]:
    root = _stdlib_dir()
    files = _walk(root, _is_prose_file)
    topics = root / "pydoc_data" / "topics.py"
    if topics.exists():
        files.append(topics)
    return hash_order((str(p.relative_to(root)), p) for p in files)


def _package_files(source: SourceSpec) -> list[tuple[str, Path]]:
    part = PACKAGE_PARTS[source.builtin]
    root = corpus_dir() / part
    files = sorted(root.glob("*.jsonl"))
    if not files:
        raise DataError(f"data source {source.name!r}: no corpus in {root}; build it with `make corpus` "
                        f"(or `ladder data corpus --out {corpus_dir()}`)")
    return [(f"{part}/{p.name}", p) for p in files]


def _user_files(source: SourceSpec) -> list[tuple[str, Path]]:
    files: list[Path] = []
    for pattern in source.paths:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded, recursive=True)) if glob.has_magic(expanded) else [expanded]
        matches = [m for m in matches if not Path(m).is_dir()]
        if not matches or not all(Path(m).exists() for m in matches):
            raise DataError(f"data source {source.name!r}: no file matches {pattern!r}")
        for m in matches:
            suffix = Path(m).suffix.lower()
            if suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES:
                raise DataError(
                    f"data source {source.name!r}: {m} has an unsupported type {suffix or '(no suffix)'!r}; "
                    f"use {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
                )
            files.append(Path(m).resolve())
    return [(str(p), p) for p in files]


def source_files(source: SourceSpec) -> list[tuple[str, Path]]:
    """[(name, path)] of every file of the source, in the order its documents are concatenated."""
    if source.builtin == "python_code":
        files = _python_code_files()
    elif source.builtin == "python_docs":
        files = _python_docs_files()
    elif source.builtin in PACKAGE_PARTS:
        files = _package_files(source)
    else:
        files = _user_files(source)
    if not files:
        raise DataError(f"data source {source.name!r}: no files found for {source.builtin or source.paths}")
    return files


def _pydoc_topics(path: Path) -> list[tuple[str, bytes]]:
    """The reference manual's topics, read as a literal (the file is not imported)."""
    tree = ast.parse(path.read_bytes())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [(f"pydoc_data/topics.py#{k}", v.encode()) for k, v in sorted(topics.items())]
    return []


def _read_jsonl(source: SourceSpec, path: Path, key: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"data source {source.name!r}: {path}:{lineno} is not valid JSON ({err.msg})") from err
            if not isinstance(rec, dict) or key not in rec:
                raise DataError(f"data source {source.name!r}: {path}:{lineno} has no {key!r} field")
            text = rec[key]
            if not isinstance(text, str):
                raise DataError(f"data source {source.name!r}: {path}:{lineno} field {key!r} is not text")
            yield text.encode()


def _read_parquet(source: SourceSpec, path: Path) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(why: object) -> DataError:
        return DataError(f"data source {source.name!r}: cannot read column {source.text_key!r} from {path}: {why}")

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if source.text_key not in names:
            raise unreadable(f"no such column (the file has {', '.join(names) or 'none'})")
        for batch in pf.iter_batches(batch_size=1024, columns=[source.text_key]):
            for t in batch.column(0).to_pylist():
                if t and not isinstance(t, str):
                    raise unreadable(f"a value is {type(t).__name__}, not text")
                if t:
                    yield t.encode()
    except (pa.ArrowException, OSError) as err:  # a damaged or truncated file, an unreadable one
        raise unreadable(err) from err


_SPACE = b" \t\r\n\x0b\x0c"


def _line_start_cut(buf: bytes | bytearray, lo: int) -> int:
    """The last offset in buf after a newline (found at or past lo) that has a non-space byte on
    either side (0 if none)."""
    at = len(buf) - 1
    while True:
        nl = buf.rfind(b"\n", max(lo, 1), at)
        if nl < 0:
            return 0
        if buf[nl + 1] not in _SPACE and buf[nl - 1] not in _SPACE:
            return nl + 1
        at = nl


def _pieces(path: Path, piece_bytes: int) -> Iterator[bytes]:
    """A raw-bytes file in pieces of about piece_bytes, each cut just after a newline between two
    non-space characters (see Streaming)."""
    buf = bytearray()
    with open(path, "rb") as f:
        while block := f.read(piece_bytes):
            buf += block
            if len(buf) >= piece_bytes:
                cut = _line_start_cut(buf, max(len(buf) - len(block) - 2, 0))  # the rest has none
                if cut > 0:
                    yield bytes(buf[:cut])
                    del buf[:cut]
    if buf:
        yield bytes(buf)


def iter_docs(source: SourceSpec, name: str, path: Path,
              piece_bytes: int | None = PIECE_BYTES) -> Iterator[tuple[str, Iterator[bytes]]]:
    """The non-empty documents of one file, in file order, each as (name, its pieces); a
    document's pieces must be read before the next document (see Streaming). piece_bytes None:
    every document in one piece."""
    def one(d: bytes) -> Iterator[bytes]:
        yield d

    def checked(pieces: Iterator[bytes]) -> Iterator[bytes]:
        try:
            yield from pieces
        except OSError as err:
            raise DataError(f"data source {source.name!r}: cannot read {path}: {err.strerror or err}") from err

    try:
        if source.builtin == "python_docs" and name.endswith("topics.py"):
            docs = ((n, one(d)) for n, d in _pydoc_topics(path) if d)
        elif source.builtin in PACKAGE_PARTS:
            docs = ((f"{name}:{i}", one(d)) for i, d in enumerate(_read_jsonl(source, path, "text")) if d)
        elif source.builtin is None and path.suffix.lower() in JSONL_SUFFIXES:
            docs = ((f"{name}:{i}", one(d)) for i, d in enumerate(_read_jsonl(source, path, source.text_key)) if d)
        elif source.builtin is None and path.suffix.lower() in PARQUET_SUFFIXES:
            docs = ((f"{name}:{i}", one(d)) for i, d in enumerate(_read_parquet(source, path)))
        elif piece_bytes is None:
            docs = iter([(name, one(path.read_bytes()))])
        else:
            docs = iter([(name, checked(_pieces(path, piece_bytes)))] if path.stat().st_size else [])
        yield from docs
    except OSError as err:
        raise DataError(f"data source {source.name!r}: cannot read {path}: {err.strerror or err}") from err


def read_docs(source: SourceSpec, name: str, path: Path) -> list[tuple[str, bytes]]:
    """The non-empty documents of one file, in file order."""
    return [(n, d) for n, d in ((n, b"".join(p)) for n, p in iter_docs(source, name, path, None)) if d]
