"""The one deterministic token stream every engine reads (numpy only: no torch, no jax).

API
---
    stream = TokenStream.from_spec(spec)       # loads (or builds and caches) every source
    x_BS1 = stream.batch(step)                 # np.int32 [B, S+1]: inputs x[:, :-1], targets x[:, 1:]
    x_BS1 = stream.eval_batch(i)               # the i-th held-out batch (fixed mixture, fixed shape)
    stream.mixture_at(step)                    # {source name: normalised weight} in effect at `step`
    stream.seq_len_at(step), stream.batch_size_at(step)
    stream.fingerprint                         # hash of the token content of every source
    stream.state(step)                         # what a checkpoint's state.json records about the data
    load_source(source_spec, ...)              # one source's SourceTokens (train / eval arrays)

Determinism. `batch(step)` depends only on (seed, step, the mixture in effect at that step,
the sequence length at that step) and the sources' token arrays: there is no iterator state.
Each step owns a counter-based generator, Philox keyed by SeedSequence([seed, DATA_TAG, step]);
its first 2*B raw 64-bit outputs decide, per row b, the source (raw[2b] mapped to [0, 1) and
compared with the cumulative mixture weights, sources in spec order) and the window start
(raw[2b+1] modulo the number of start positions in that source's training split). Resume is
therefore exact, and a replan that changes the mix from step s on leaves steps < s unchanged.
Raw Philox outputs are used (not Generator.random / integers) so the stream does not depend on
numpy's sampling algorithms.

Mixture. The sources' weights apply until the first phase; a phase (spec.data.phases) takes
effect at step floor(start_frac * total_steps) with its own weights, sources it does not name
get weight 0. Weights are normalised per step.

Sequence length. spec.data.seq_len until the first ungated context stage
(spec.data.context_stages with gated=False) whose start step floor(start_frac * total_steps)
has been reached; gated stages wait for a replan that ungates them. Tokens per step stay
constant: batch_size_at(step) = max(1, batch_size * seq_len // seq_len_at(step)).

Sources. `builtin: python_code` is the Python installation's own standard library source
(sysconfig stdlib dir, *.py, without site-packages / dist-packages / test directories, so a
fresh venv of the same Python reads the same files), capped at BUILTIN_CODE_CAP bytes.
`builtin: python_docs` is prose the same installation ships: the reference manual text in
pydoc_data/topics.py (one document per topic) and the stdlib's *.txt / *.rst / *.md / README* /
LICENSE* files (same exclusions). Documents are ordered by a hash of their name (so the
held-out tail is a spread of documents, not the alphabet's end) and joined by DOC_SEP.
`paths:` are files or globs (~ expanded, sorted): .txt .text .md .rst .py are read as raw bytes,
.jsonl / .ndjson take each line's `text_key` field, .parquet the `text_key` column.

Tokens. tokenizer "bytes": a token is a byte (vocab 256), arrays are uint8. Each source's
array is cached under $MOE_LADDER_CACHE (default ~/.cache/moe-ladder)/tokens/, keyed by a hash
of the tokenizer, the source's origin and each file's (path, size, mtime); written atomically.

Held-out split. The last max(ceil(eval_fraction * n), max_seq_len + 1) tokens of each source
are held out for eval_batch; training windows never touch them (disjoint by construction).
max_seq_len is the largest sequence length of any context stage, gated or not, so the split
does not move when a stage opens.

Errors. A missing source (no file matches, unreadable, missing text_key) or an empty or too
short one raises DataError (a ValueError) whose message names the source.
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from core.spec import DataSpec, SourceSpec, Spec

DOC_SEP = 0  # byte 0 never occurs in text; it marks a document boundary (an end-of-text token)
DATA_TAG = 0x64617461  # "data"
EVAL_TAG = 0x6576616C  # "eval"
BUILTIN_CODE_CAP = 8 * 2**20
CACHE_VERSION = 1
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class DataError(ValueError):
    """A data source that cannot be read; the message names the source."""


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_LADDER_CACHE") or Path.home() / ".cache" / "moe-ladder")


# ---- documents -------------------------------------------------------------------------------


def _stdlib_dir() -> Path:
    # In a venv sysconfig's "stdlib" already points into the base installation.
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, want) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for f in sorted(filenames):
            if want(f):
                out.append(Path(dirpath) / f)
    return out


def _hash_order(named: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
    return sorted(named, key=lambda kv: (hashlib.sha1(kv[0].encode()).hexdigest(), kv[0]))


def _python_code_files() -> list[tuple[str, Path]]:
    root = _stdlib_dir()
    files = _walk(root, lambda f: f.endswith(".py"))
    chosen, total = [], 0
    for rel, path in _hash_order((str(p.relative_to(root)), p) for p in files):
        if total >= BUILTIN_CODE_CAP:
            break
        chosen.append((rel, path))
        total += path.stat().st_size
    return chosen


def _is_prose_file(name: str) -> bool:
    return name.endswith((".txt", ".rst", ".md")) or name.startswith(("README", "LICENSE"))


def _python_docs_files() -> list[tuple[str, Path]]:
    root = _stdlib_dir()
    files = [p for p in _walk(root, _is_prose_file)]
    topics = root / "pydoc_data" / "topics.py"
    if topics.exists():
        files.append(topics)
    return [(str(p.relative_to(root)), p) for p in files]


def _pydoc_topics(path: Path) -> list[tuple[str, bytes]]:
    """The reference manual's topics, read as a literal (the file is not imported)."""
    tree = ast.parse(path.read_bytes())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return [(f"pydoc_data/topics.py#{k}", v.encode()) for k, v in sorted(topics.items())]
    return []


def _user_files(source: SourceSpec) -> list[Path]:
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
    return files


def _read_jsonl(source: SourceSpec, path: Path) -> list[bytes]:
    docs = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"data source {source.name!r}: {path}:{lineno} is not valid JSON ({err.msg})") from err
            if not isinstance(rec, dict) or source.text_key not in rec:
                raise DataError(f"data source {source.name!r}: {path}:{lineno} has no {source.text_key!r} field")
            text = rec[source.text_key]
            if not isinstance(text, str):
                raise DataError(f"data source {source.name!r}: {path}:{lineno} field {source.text_key!r} is not text")
            docs.append(text.encode())
    return docs


def _read_parquet(source: SourceSpec, path: Path) -> list[bytes]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=[source.text_key])
    except Exception as err:  # pyarrow raises several types for a missing column or a bad file
        raise DataError(
            f"data source {source.name!r}: cannot read column {source.text_key!r} from {path}: {err}"
        ) from err
    return [t.encode() for t in table.column(source.text_key).to_pylist() if t]


def _documents(source: SourceSpec) -> tuple[list[tuple[str, Path]], callable]:
    """(files with their names, a reader returning [(doc name, bytes)] for one file)."""
    if source.builtin == "python_code":
        return _python_code_files(), lambda name, p: [(name, p.read_bytes())]
    if source.builtin == "python_docs":

        def read(name, p):
            return _pydoc_topics(p) if name.endswith("topics.py") else [(name, p.read_bytes())]

        return _python_docs_files(), read
    files = [(str(p), p) for p in _user_files(source)]

    def read_user(name, p):
        suffix = p.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            return [(f"{name}:{i}", d) for i, d in enumerate(_read_jsonl(source, p))]
        if suffix in PARQUET_SUFFIXES:
            return [(f"{name}:{i}", d) for i, d in enumerate(_read_parquet(source, p))]
        return [(name, p.read_bytes())]

    return files, read_user


# ---- per-source token arrays -----------------------------------------------------------------


@dataclass(frozen=True)
class SourceTokens:
    name: str
    tokens: np.ndarray  # uint8 [n], the whole source
    split: int  # tokens[:split] train, tokens[split:] held out
    digest: str  # sha256 of the token bytes
    n_docs: int

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.split]

    @property
    def eval(self) -> np.ndarray:
        return self.tokens[self.split :]


def _cache_key(source: SourceSpec, tokenizer: str, files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    origin = {"builtin": source.builtin, "text_key": source.text_key, "tokenizer": tokenizer, "v": CACHE_VERSION}
    if source.builtin == "python_code":
        origin["cap"] = BUILTIN_CODE_CAP
    h.update(json.dumps(origin, sort_keys=True).encode())
    for name, p in files:
        st = p.stat()
        h.update(f"{name}\0{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _tokenize(source: SourceSpec, tokenizer: str, files, read) -> tuple[np.ndarray, int]:
    if tokenizer != "bytes":
        raise DataError(
            f"data source {source.name!r}: tokenizer {tokenizer!r} is not available offline; use tokenizer: bytes"
        )
    docs: list[tuple[str, bytes]] = []
    for name, p in files:
        try:
            docs.extend(read(name, p))
        except OSError as err:
            raise DataError(f"data source {source.name!r}: cannot read {p}: {err.strerror or err}") from err
    if source.builtin is not None:
        docs = _hash_order(docs)  # user files keep their sorted order (the user may care about it)
    docs = [(n, d.replace(b"\0", b"")) for n, d in docs if d]
    if not docs:
        return np.zeros(0, np.uint8), 0
    sep = bytes([DOC_SEP])
    blob = sep.join(d for _, d in docs) + sep
    return np.frombuffer(blob, dtype=np.uint8).copy(), len(docs)


def _atomic_save_npy(path: Path, arr: np.ndarray, meta: dict) -> None:
    from core.fsutil import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
        f.flush()
        os.fsync(f.fileno())
    atomic_write_json(path.with_suffix(".json"), meta)
    os.replace(tmp, path)  # the array last: its presence means the metadata is there too


def load_source(source: SourceSpec, tokenizer: str = "bytes", eval_fraction: float = 0.01,
                min_eval: int = 2, use_cache: bool = True) -> SourceTokens:
    """One source's tokens with its held-out split (the last max(ceil(f*n), min_eval) tokens)."""
    files, read = _documents(source)
    if not files:
        raise DataError(f"data source {source.name!r}: no files found for {source.builtin or source.paths}")
    key = _cache_key(source, tokenizer, files)
    path = cache_dir() / "tokens" / f"{source.builtin or 'files'}-{key}.npy"
    tokens = None
    if use_cache and path.exists():
        try:
            tokens = np.load(path, mmap_mode="r")
            meta = json.loads(path.with_suffix(".json").read_text())
            digest, n_docs = meta["digest"], meta["n_docs"]
        except (OSError, ValueError, KeyError):
            tokens = None  # a damaged cache entry is rebuilt
    if tokens is None:
        tokens, n_docs = _tokenize(source, tokenizer, files, read)
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()
        if use_cache and len(tokens):
            _atomic_save_npy(path, tokens, {"digest": digest, "n_docs": n_docs, "source": source.name})
    n = len(tokens)
    if n == 0:
        raise DataError(f"data source {source.name!r} is empty (no text in {source.builtin or source.paths})")
    n_eval = max(math.ceil(eval_fraction * n), min_eval)
    if n - n_eval < min_eval:
        raise DataError(
            f"data source {source.name!r} has {n} tokens: too few for a training and a held-out split "
            f"of at least {min_eval} tokens each (sequence length + 1)"
        )
    return SourceTokens(source.name, tokens, n - n_eval, digest, n_docs)


# ---- the stream -------------------------------------------------------------------------------


def _philox(seed: int, tag: int, index: int) -> np.random.Philox:
    return np.random.Philox(np.random.SeedSequence([seed, tag, index]))


def _unit(raw: np.ndarray) -> np.ndarray:
    return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class TokenStream:
    def __init__(self, data: DataSpec, seed: int, total_steps: int, use_cache: bool = True):
        self.data = data
        self.seed = seed
        self.total_steps = total_steps
        self.names = [s.name for s in data.sources]
        self.max_seq_len = max([data.seq_len] + [c.seq_len for c in data.context_stages])
        self.sources = {
            s.name: load_source(s, data.tokenizer, data.eval_fraction, self.max_seq_len + 1, use_cache)
            for s in data.sources
        }
        self._phase_starts = sorted(((int(p.start_frac * total_steps), p) for p in data.phases), key=lambda sp: sp[0])
        self._stages = sorted(
            (int(c.start_frac * total_steps), c.seq_len) for c in data.context_stages if not c.gated
        )

    @classmethod
    def from_spec(cls, spec: Spec, use_cache: bool = True) -> "TokenStream":
        return cls(spec.data, spec.seed, spec.total_steps, use_cache)

    # ---- schedule of the stream ----
    def mixture_at(self, step: int) -> dict[str, float]:
        weights = {s.name: s.weight for s in self.data.sources}
        for start, phase in self._phase_starts:
            if step >= start:
                weights = {n: phase.weights.get(n, 0.0) for n in self.names}
        total = sum(weights.values())
        return {n: w / total for n, w in weights.items()}

    def base_mixture(self) -> dict[str, float]:
        total = sum(s.weight for s in self.data.sources)
        return {s.name: s.weight / total for s in self.data.sources}

    def seq_len_at(self, step: int) -> int:
        seq = self.data.seq_len
        for start, s in self._stages:
            if step >= start:
                seq = s
        return seq

    def batch_size_at(self, step: int) -> int:
        return max(1, self.data.batch_size * self.data.seq_len // self.seq_len_at(step))

    # ---- batches ----
    def _sample(self, bitgen: np.random.Philox, mixture: dict[str, float], batch: int, seq: int,
                split: str) -> np.ndarray:
        raw = bitgen.random_raw(2 * batch).reshape(batch, 2)
        u_B = _unit(raw[:, 0])
        cum = np.cumsum([mixture[n] for n in self.names])
        cum[-1] = np.inf  # rounding never leaves a row without a source
        src_B = np.searchsorted(cum, u_B, side="right")
        out_BS1 = np.empty((batch, seq + 1), dtype=np.int32)
        for i, name in enumerate(self.names):
            rows = np.nonzero(src_B == i)[0]
            if len(rows) == 0:
                continue
            arr = getattr(self.sources[name], split)
            n_starts = len(arr) - seq
            starts = (raw[rows, 1] % np.uint64(n_starts)).astype(np.int64)
            windows = np.lib.stride_tricks.sliding_window_view(arr, seq + 1)
            out_BS1[rows] = windows[starts]
        return out_BS1

    def batch(self, step: int) -> np.ndarray:
        """Training batch of `step` (0-based): int32 [B, S+1]."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        return self._sample(_philox(self.seed, DATA_TAG, step), self.mixture_at(step),
                            self.batch_size_at(step), self.seq_len_at(step), "train")

    def eval_batch(self, i: int) -> np.ndarray:
        """The i-th held-out batch: base mixture, spec.data.seq_len and batch_size, int32 [B, S+1]."""
        return self._sample(_philox(self.seed, EVAL_TAG, i), self.base_mixture(),
                            self.data.batch_size, self.data.seq_len, "eval")

    # ---- identity ----
    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for n in self.names:
            h.update(f"{n}:{self.sources[n].digest}:{self.sources[n].split}\n".encode())
        return h.hexdigest()[:16]

    def state(self, step: int) -> dict:
        """The data state a checkpoint records: with (seed, step) the stream is fully determined."""
        return {"seed": self.seed, "next_step": step, "fingerprint": self.fingerprint,
                "tokenizer": self.data.tokenizer}

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the token unigram distribution of the base mixture's training data:
        the loss of a model that ignores context."""
        p = np.zeros(256 if self.data.tokenizer == "bytes" else 0, np.float64)
        for n, w in self.base_mixture().items():
            counts = np.bincount(np.asarray(self.sources[n].train), minlength=len(p)).astype(np.float64)
            p += w * counts / counts.sum()
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())
