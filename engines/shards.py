"""Pre-tokenized shards: every source tokenized once into memory-mapped token files.

    shards = prepare(source, tokenizer, workers=8, progress=cb)   # tokenize (or reuse) -> ShardSet
    shards = open_shards(source, tokenizer)                        # the prepared ShardSet, or None
    shards.gather(starts_K, length)                                # int32 [K, length] windows

Layout. A source's shards live in $MOE_LADDER_CACHE/shards/<key>/, where the key hashes the
tokenizer's content, the source's origin (builtin or text_key) and every input file's (path,
size, mtime): two specs naming the same files with the same tokenizer share one set of shards,
and a changed file or tokenizer makes a new set. The source's files, in order, are cut into
chunks of about $MOE_LADDER_LIMITS shard_chunk_bytes of input (core/env.Limits); chunk i becomes
    part-i.bin        the token ids (uint8 for bytes, uint16 below 65,536 ids, else uint32), every
                      document followed by the tokenizer's end-of-text id
    part-i.docs.npy   int64 end offset of every document in the part (the document index)
    part-i.json       its token and document counts, largest id and sha256 (written last)
and index.json, written once every part is there, lists the parts with their sizes and digests;
the source's token array is the parts' concatenation, read through np.memmap.

Parallel, resumable, atomic. Chunks are tokenized by a pool of `workers` processes (spawned,
each tokenizer single-threaded, each killed by the kernel if its parent dies); each file is written to a temporary name and renamed, so after
an interrupt or SIGKILL a rerun keeps every finished part and redoes only the rest. A source that
fails (empty, unreadable, an id beyond the model's vocabulary) leaves nothing behind.

Checks on open (cheap): a part whose size is not its token count times the dtype's size is
truncated; a part whose mtime changed is hashed again and must still match its sha256. Both are
DataError naming the source and the file. `verify(full=True)` hashes every part.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
from array import array
from pathlib import Path
from typing import Callable

import numpy as np

from core import env
from core.fsutil import atomic_write_bytes, atomic_write_json, atomic_writer
from core.procs import die_with_parent
from core.spec import SourceSpec
from engines.sources import BUILTIN_CODE_CAP, PIECE_BYTES, DataError, cache_dir, iter_docs, source_files
from engines.tokenizer import Tokenizer, load_tokenizer

SHARD_VERSION = 1
BATCH_BYTES = 4 * 2**20  # text tokenized in one call (a bound on the tokenizer's memory)
Progress = Callable[[int, int], None]  # (input bytes done, input bytes in all)


def chunk_bytes() -> int:
    return env.Limits.from_env().shard_chunk_bytes


def _key(source: SourceSpec, tok: Tokenizer, files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    origin = {"builtin": source.builtin, "text_key": source.text_key, "tokenizer": tok.digest,
              "v": SHARD_VERSION, "chunk": chunk_bytes()}
    if source.builtin == "python_code":
        origin["cap"] = BUILTIN_CODE_CAP
    h.update(json.dumps(origin, sort_keys=True).encode())
    for name, p in files:
        st = p.stat()
        h.update(f"{name}\0{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _chunks(files: list[tuple[str, Path]]) -> list[list[tuple[str, str]]]:
    out, cur, size, limit = [], [], 0, chunk_bytes()
    for name, p in files:
        cur.append((name, str(p)))
        size += p.stat().st_size
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def shard_dir(source: SourceSpec, tok: Tokenizer, files: list[tuple[str, Path]] | None = None) -> Path:
    files = source_files(source) if files is None else files
    return cache_dir() / "shards" / f"{source.builtin or 'files'}-{_key(source, tok, files)}"


# ---- writing ---------------------------------------------------------------------------------


def _init_worker(parent: int) -> None:
    die_with_parent(parent, signal.SIGKILL)  # a pool worker never outlives `data prepare`, however it ended
    os.environ["RAYON_NUM_THREADS"] = "1"  # one tokenizer thread per process: the pool is the parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _tokenize_chunk(source_json: str, tokenizer: str, index: int, chunk: list[tuple[str, str]], out: str,
                    vocab_limit: int | None) -> dict:
    """Tokenize one chunk of files into part-<index>, streaming: documents are read and tokenized
    BATCH_BYTES of text at a time (a long one in pieces, engines/sources.py: Streaming) and their
    ids written as they come, so memory stays bounded whatever the size of a file."""
    source = SourceSpec.model_validate_json(source_json)
    tok = load_tokenizer(tokenizer)
    out_dir = Path(out)
    stem = f"part-{index:05d}"
    ends = array("q")
    state = {"n": 0, "max_id": -1, "path": ""}
    digest = hashlib.sha256()
    eos = np.asarray([tok.eos_id], dtype=tok.dtype)
    piece = PIECE_BYTES if tok.cuts_at_line_starts else None

    with atomic_writer(out_dir / f"{stem}.bin") as f:
        def emit(ids: np.ndarray, check: bool = True) -> None:
            if check and vocab_limit is not None and len(ids) and int(ids.max()) >= vocab_limit:
                raise DataError(f"data source {source.name!r}: {state['path']} makes token id {int(ids.max())} >= "
                                f"model.vocab_size {vocab_limit} (tokenizer {tok.describe()})")
            data = np.ascontiguousarray(ids, dtype=tok.dtype).tobytes()
            f.write(data)
            digest.update(data)
            state["n"] += len(ids)
            if len(ids):
                state["max_id"] = max(state["max_id"], int(ids.max()))

        batch: list[bytes] = []

        def flush() -> None:
            for ids in tok.encode_docs(batch) if batch else ():
                emit(ids)
                emit(eos, check=False)
                ends.append(state["n"])
            batch.clear()

        held = 0
        for name, path in chunk:
            state["path"] = path
            for _, pieces in iter_docs(source, name, Path(path), piece):
                first = next(pieces)
                rest = next(pieces, None)
                if rest is None:  # one piece: batched with other small documents
                    batch.append(first)
                    held += len(first)
                    if held >= BATCH_BYTES:
                        flush()
                        held = 0
                    continue
                flush()  # a long document: its pieces one after another, then its end
                held = 0
                for p in itertools.chain((first, rest), pieces):
                    (ids,) = tok.encode_docs([p])
                    emit(ids)
                emit(eos, check=False)
                ends.append(state["n"])
            flush()
            held = 0
    atomic_write_bytes(out_dir / f"{stem}.docs.npy", _npy_bytes(np.frombuffer(ends, np.int64)))
    meta = {"file": f"{stem}.bin", "n_tokens": state["n"], "n_docs": len(ends), "max_id": state["max_id"],
            "sha256": digest.hexdigest(), "input_bytes": sum(Path(p).stat().st_size for _, p in chunk)}
    atomic_write_json(out_dir / f"{stem}.json", meta)
    return meta


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def _done_part(out_dir: Path, index: int, itemsize: int) -> dict | None:
    meta_path = out_dir / f"part-{index:05d}.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if (out_dir / meta["file"]).stat().st_size == meta["n_tokens"] * itemsize:
            return meta
    except (OSError, ValueError, KeyError):
        pass
    return None  # damaged by an interrupt: redo it


def prepare(source: SourceSpec, tokenizer: str | Tokenizer, workers: int | None = None,
            progress: Progress | None = None, vocab_limit: int | None = None, rebuild: bool = False) -> "ShardSet":
    """Tokenize `source` into shards (or reuse the finished ones); the ShardSet of its tokens."""
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    files = source_files(source)
    out_dir = shard_dir(source, tok, files)
    if rebuild and out_dir.exists():
        shutil.rmtree(out_dir)
    if (out_dir / "index.json").exists():
        shards = ShardSet.open(source.name, out_dir)
        shards.check_vocab(vocab_limit)
        if progress:
            total = shards.index.get("input_bytes", 0)
            progress(total, total)
        return shards
    fresh = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _prepare_parts(source, tok, files, out_dir, workers, progress, vocab_limit)
    except DataError:
        if fresh:
            shutil.rmtree(out_dir, ignore_errors=True)  # bad input leaves nothing behind
        raise


def _prepare_parts(source, tok, files, out_dir, workers, progress, vocab_limit) -> "ShardSet":
    chunks = _chunks(files)
    sizes = [sum(Path(p).stat().st_size for _, p in c) for c in chunks]
    total, done_bytes = sum(sizes), 0
    metas: dict[int, dict] = {}
    for i in range(len(chunks)):
        m = _done_part(out_dir, i, tok.dtype.itemsize)
        if m is not None:
            metas[i] = m
            done_bytes += sizes[i]
    if progress:
        progress(done_bytes, total)
    todo = [i for i in range(len(chunks)) if i not in metas]
    tok_arg = str(tok.path) if tok.path else "bytes"
    args = [(source.model_dump_json(), tok_arg, i, chunks[i], str(out_dir), vocab_limit) for i in todo]
    workers = max(1, min(workers or 1, len(todo)))
    if mp.current_process().daemon:
        workers = 1  # a daemonic process may not have children
    if workers == 1:
        for a in args:
            metas[a[2]] = _tokenize_chunk(*a)
            done_bytes += sizes[a[2]]
            if progress:
                progress(done_bytes, total)
    else:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                    initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_tokenize_chunk, *a): a[2] for a in args}
            try:
                for fut in cf.as_completed(futures):
                    i = futures[fut]
                    metas[i] = fut.result()
                    done_bytes += sizes[i]
                    if progress:
                        progress(done_bytes, total)
            except BaseException:  # a failed chunk, Ctrl-C: the chunks not started yet are cancelled, the error goes on
                for f in futures:
                    f.cancel()
                raise
    parts = [metas[i] for i in range(len(chunks))]
    n_tokens = sum(p["n_tokens"] for p in parts)
    if n_tokens == 0:
        raise DataError(f"data source {source.name!r} is empty (no text in {source.builtin or ', '.join(source.paths)})")
    for p in parts:
        st = (out_dir / p["file"]).stat()
        p["size"], p["mtime_ns"] = st.st_size, st.st_mtime_ns
    digest = hashlib.sha256("".join(p["sha256"] for p in parts).encode()).hexdigest()
    index = {"version": SHARD_VERSION, "source": source.name, "tokenizer": tok.name, "tokenizer_digest": tok.digest,
             "tokenizer_path": str(tok.path) if tok.path else None, "dtype": tok.dtype.name,
             "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "n_tokens": n_tokens,
             "n_docs": sum(p["n_docs"] for p in parts), "max_id": max(p["max_id"] for p in parts),
             "input_bytes": total, "digest": digest, "parts": parts}
    atomic_write_json(out_dir / "index.json", index)
    return ShardSet.open(source.name, out_dir)


def open_shards(source: SourceSpec, tokenizer: str | Tokenizer) -> "ShardSet | None":
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    out_dir = shard_dir(source, tok)
    return ShardSet.open(source.name, out_dir) if (out_dir / "index.json").exists() else None


# ---- reading ---------------------------------------------------------------------------------


class ShardSet:
    """One source's tokens: the concatenation of its memory-mapped parts."""

    def __init__(self, name: str, directory: Path, index: dict, parts: list[np.ndarray]):
        self.name, self.dir, self.index = name, directory, index
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
        self.n_tokens = int(self.offsets[-1])
        self.digest = index["digest"]
        self.max_id = int(index["max_id"])
        self.n_docs = int(index["n_docs"])

    @classmethod
    def open(cls, name: str, directory: Path) -> "ShardSet":
        try:
            index = json.loads((directory / "index.json").read_text())
            dtype = np.dtype(index["dtype"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"data source {name!r}: shard index {directory / 'index.json'} is unreadable ({err}); "
                            f"run `ladder data prepare --rebuild`") from err
        parts = []
        for p in index["parts"]:
            path = directory / p["file"]
            want = p["n_tokens"] * dtype.itemsize
            try:
                st = path.stat()
            except OSError:
                raise DataError(f"data source {name!r}: shard {path} is missing; run `ladder data prepare --rebuild`")
            if st.st_size != want:
                raise DataError(f"data source {name!r}: shard {path} is truncated ({st.st_size:,} of {want:,} bytes); "
                                f"run `ladder data prepare --rebuild`")
            if st.st_mtime_ns != p["mtime_ns"] and _sha256(path) != p["sha256"]:
                raise DataError(f"data source {name!r}: shard {path} no longer matches its fingerprint; "
                                f"run `ladder data prepare --rebuild`")
            if p["n_tokens"]:
                parts.append(np.memmap(path, dtype=dtype, mode="r", shape=(p["n_tokens"],)))
        return cls(name, directory, index, parts)

    def verify(self) -> None:
        """Hash every part again; DataError naming the first that no longer matches."""
        for p in self.index["parts"]:
            path = self.dir / p["file"]
            if _sha256(path) != p["sha256"]:
                raise DataError(f"data source {self.name!r}: shard {path} no longer matches its fingerprint; "
                                f"run `ladder data prepare --rebuild`")

    def check_vocab(self, vocab_limit: int | None) -> None:
        if vocab_limit is None or self.max_id < vocab_limit:
            return
        for p in self.index["parts"]:
            if p["max_id"] >= vocab_limit:
                raise DataError(f"data source {self.name!r}: shard {self.dir / p['file']} holds token id "
                                f"{p['max_id']} >= model.vocab_size {vocab_limit}")

    def __len__(self) -> int:
        return self.n_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """tokens[start:start+length] as a new array."""
        return self.gather(np.asarray([start], np.int64), length)[0]

    def gather(self, starts_K: np.ndarray, length: int) -> np.ndarray:
        """int32 [K, length]: the windows tokens[s:s+length] for s in starts_K (only they are read)."""
        starts_K = np.asarray(starts_K, np.int64)
        out_KL = np.empty((len(starts_K), length), np.int32)
        part_K = np.searchsorted(self.offsets, starts_K, side="right") - 1
        inside_K = starts_K + length <= self.offsets[np.minimum(part_K + 1, len(self.parts))]
        span_L = np.arange(length, dtype=np.int64)
        inside = np.nonzero(inside_K)[0]
        if len(inside):
            lo, hi = int(part_K[inside].min()), int(part_K[inside].max())
            for p in range(lo, hi + 1):
                rows = inside if lo == hi else inside[part_K[inside] == p]
                if len(rows):
                    out_KL[rows] = self.parts[p][(starts_K[rows] - self.offsets[p])[:, None] + span_L]
        for r in np.nonzero(~inside_K)[0]:  # a window across a part boundary
            s, e, row, at = int(starts_K[r]), int(starts_K[r]) + length, out_KL[r], 0
            p = int(part_K[r])
            while s < e:
                take = min(e, int(self.offsets[p + 1])) - s
                row[at:at + take] = self.parts[p][s - self.offsets[p]: s - self.offsets[p] + take]
                s, at, p = s + take, at + take, p + 1
        return out_KL

    def doc_ends(self) -> np.ndarray:
        """int64 [n_docs]: the end offset (exclusive) of every document in the source's token array."""
        ends, k = [], 0
        for p in self.index["parts"]:
            if p["n_tokens"]:  # empty parts hold no memmap, so offsets count the others only
                ends.append(np.load(self.dir / f"{Path(p['file']).stem}.docs.npy").astype(np.int64) + self.offsets[k])
                k += 1
        return np.concatenate(ends) if ends else np.zeros(0, np.int64)

    def to_array(self) -> np.ndarray:
        """Every token in one in-memory array (for small sources and tests)."""
        return np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, np.uint8)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
