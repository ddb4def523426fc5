"""The one deterministic token stream every engine reads (numpy only: no torch, no jax).

API
---
    stream = TokenStream.from_spec(spec)       # opens (or prepares) every source's token shards
    x_BS1 = stream.batch(step)                 # np.int32 [B, S+1]: inputs x[:, :-1], targets x[:, 1:]
    x_bS1 = stream.batch(step, rank=r, world=R)  # rank r's rows of that batch, only they are read
    stream.eval_plan(windows=None)             # [(source, rows)]: the fixed eval set's batches, in order
    x_BS1 = stream.eval_batch(source, rows)    # those windows of that source's eval set (int32)
    stream.eval_fingerprint                    # the eval set's identity (status.json; fits compare it)
    stream.mixture_at(step), stream.seq_len_at(step), stream.batch_size_at(step)
    stream.epochs()                            # {source: passes over its training windows in the run}
    stream.fingerprint                         # hash of the tokenizer and every source's tokens
    stream.state(step)                         # what a checkpoint's state.json records about the data
    load_source(source_spec, ...)              # one source's SourceTokens (memory-mapped shards)
    schedule_epochs(data, total_steps, train_tokens)  # the same epochs from token counts alone

Tokens. spec.data.tokenizer is bytes, a tokenizer.json, or a preset (engines.tokenizer). Every
source is tokenized once into memory-mapped shards (engines.shards): documents end with the
tokenizer's end-of-text id, and training reads windows straight from the np.memmap parts.

Held out by document. Every source has a fixed eval set (engines.evalset): about
min(data.eval_tokens, eval_fraction * n) tokens in windows of eval_seq_len + 1, drawn across the
whole source, whose documents are held out whole. It depends on the source's tokens and the
window only, so every run of an experiment (any seed, batch, sequence length, engine or ranks)
scores the same tokens. Training never reads a block that touches a held-out document.

Windows without replacement. The source is cut into blocks of K = max_seq_len + 1 tokens
(max_seq_len the largest sequence length of any context stage, gated or not, so the blocks do
not move when a stage opens); the n_blocks of them that touch no held-out document are
training's. At sequence length S a block holds m = K // (S + 1) windows of S + 1 tokens (m = 1 without context stages). A run is a list of segments (ranges of steps
with one mixture, batch size and sequence length: the phases' and ungated context stages' start
steps cut it). Within a segment that began at step a, the first n = B * (t - a) rows are shared
out by the cumulative mixture: source i owns floor(W_i * n) - floor(W_{i-1} * n) of them (W_i the
normalised weights summed over sources 0..i in spec order; W_last = 1), so a step's rows per
source, and every source's cursor at any step, are closed-form (O(segments) to compute). Source
i's c-th window of a segment lies in its block b = b0 + c // m at offset (c % m) * (S + 1), where
b0 counts the blocks earlier segments used (a block is never reused after a stage change). The
block is looked up through a stateless pseudo-random permutation of the source's blocks (a
Feistel network keyed by (seed, source name, epoch), cycle-walked onto [0, n_blocks), then
mapped to the training blocks' positions), epoch =
b // n_blocks: a window comes back only after every block of its source has been read, i.e.
past one epoch. A step's rows are then put in a pseudo-random order keyed by (seed, step), so
every data-parallel rank's share (`batch(step, rank=r, world=R)`: rows [r*B//R, (r+1)*B//R)) is a
mixture too. `batch(step)` is a pure function of (seed, step, spec data): there is no iterator
state, resume is exact, and a replan that changes the mix from step s on leaves steps < s alone.

Mixture. The sources' weights apply until the first phase; a phase (spec.data.phases) takes
effect at step floor(start_frac * total_steps) with its own weights, sources it does not name
get weight 0. Sequence length: spec.data.seq_len until the first ungated context stage whose
start step floor(start_frac * total_steps) has been reached (gated stages wait for a replan).
Tokens per step stay constant: batch_size_at(step) = max(1, batch_size * seq_len // seq_len_at(step)).

Eval. eval_plan() lists the eval set's batches: EVAL_ROWS windows of one source each (rows:
their indices in the set's reading order), sources in spec order, windows in reading order: the
final eval every window, a periodic eval each source's stratified sample of that many windows
(engines.evalset.periodic_windows, the whole set when it asks for as many); eval_batch reads one.
The trainer scores them and reports each source's mean and standard error and the base mixture's.

Errors. A missing, empty or too short source, a bad tokenizer, a token id at or above
model.vocab_size, a truncated shard or one whose fingerprint no longer matches raises DataError
(a ValueError) whose message names the source and the file.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

import numpy as np

from core.spec import DataSpec, SourceSpec, Spec
from engines.evalset import (GROUP as EVAL_ROWS, MIN_WINDOWS, EvalSet, TrainBlocks, build_eval_set, combined_fingerprint,
                             periodic_windows, train_blocks)
from engines.shards import ShardSet, prepare
from engines.sources import DataError, cache_dir  # noqa: F401  (re-exported: engines catch DataError here)
from engines.tokenizer import Tokenizer, TokenizerError, load_tokenizer

ROW_TAG = 0x726F7773  # "rows"
FEISTEL_ROUNDS = 4  # with a strong round function, 4 rounds make a pseudo-random permutation (Luby-Rackoff)
_M64 = (1 << 64) - 1


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


# ---- sources ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceTokens:
    name: str
    shards: ShardSet
    evalset: EvalSet  # the fixed held-out windows (engines.evalset)
    blocks: TrainBlocks  # the training blocks (of `block` tokens) that touch no held-out document
    block: int
    digest: str
    n_docs: int

    @property
    def n_tokens(self) -> int:
        return self.shards.n_tokens

    @property
    def split(self) -> int:
        """Training tokens: the blocks training may read."""
        return len(self.blocks) * self.block

    @property
    def tokens(self) -> np.ndarray:
        """Every token in memory (small sources and tests; training reads the shards)."""
        return self.shards.to_array()


def held_out(n: int, eval_fraction: float, min_eval: int, eval_tokens: int | None = None) -> int:
    """Tokens a source of n gives to its eval set (before whole documents and blocks round it up)."""
    cap = math.ceil(eval_fraction * n)
    return max(min(cap, eval_tokens) if eval_tokens is not None else cap, min_eval)


def load_source(source: SourceSpec, tokenizer: str | Tokenizer = "bytes", eval_fraction: float = 0.01,
                min_eval: int = 2, vocab_limit: int | None = None, workers: int | None = None,
                eval_tokens: int = 2**20, eval_window: int | None = None) -> SourceTokens:
    """One source's tokens (prepared into shards on first use), its fixed eval set of windows of
    `eval_window` tokens (default min_eval) and its training blocks of min_eval tokens."""
    try:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    except TokenizerError as err:
        raise DataError(f"data source {source.name!r}: {err}") from err
    if vocab_limit is not None and tok.vocab_size > vocab_limit:
        raise DataError(f"data source {source.name!r}: tokenizer {tok.describe()} has {tok.vocab_size:,} ids, "
                        f"more than model.vocab_size {vocab_limit:,}")
    shards = prepare(source, tok, workers=workers, vocab_limit=vocab_limit)
    n = shards.n_tokens
    block, window = min_eval, eval_window or min_eval
    if n < MIN_WINDOWS * window + 2 * block:
        raise DataError(
            f"data source {source.name!r} has {n} tokens: too few for a held-out set of {MIN_WINDOWS} windows of "
            f"{window} tokens and training (sequence length + 1 = {block} tokens at least twice)"
        )
    es = build_eval_set(source.name, shards, eval_tokens, eval_fraction, window)
    blocks = train_blocks(n, block, es.held_H2)
    if len(blocks) < 1:
        raise DataError(f"data source {source.name!r}: its eval set's documents cover every training block of "
                        f"{block} tokens; give it more text or a smaller data.eval_tokens")
    return SourceTokens(source.name, shards, es, blocks, block, shards.digest, shards.n_docs)


# ---- the schedule of windows -----------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    start: int  # first step
    end: int | None  # first step after it (None: open-ended)
    weights: tuple[float, ...]  # normalised, sources in spec order
    batch: int
    window: int  # S + 1
    per_block: int  # windows a block holds, K // window

    def rows(self, n: int) -> np.ndarray:
        """Rows of each source among the segment's first n rows: int64 [sources]."""
        cum = np.cumsum(self.weights)
        cum[-1] = 1.0
        f = np.floor(cum * float(n)).astype(np.int64)
        f[-1] = n
        return np.diff(np.concatenate([[0], f]))


def _mixture(data: DataSpec, phase_starts, step: int) -> dict[str, float]:
    weights = {s.name: s.weight for s in data.sources}
    for start, phase in phase_starts:
        if step >= start:
            weights = {s.name: phase.weights.get(s.name, 0.0) for s in data.sources}
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}


def max_seq_len(data: DataSpec) -> int:
    return max([data.seq_len] + [c.seq_len for c in data.context_stages])


def eval_seq_len(data: DataSpec) -> int:
    """Tokens an eval window predicts: data.eval_seq_len, else data.seq_len."""
    return data.eval_seq_len or data.seq_len


def segments(data: DataSpec, total_steps: int) -> list[Segment]:
    phase_starts = sorted(((int(p.start_frac * total_steps), p) for p in data.phases), key=lambda sp: sp[0])
    stages = sorted((int(c.start_frac * total_steps), c.seq_len) for c in data.context_stages if not c.gated)
    block = max_seq_len(data) + 1
    cuts = sorted({0} | {s for s, _ in phase_starts} | {s for s, _ in stages})
    out = []
    for k, a in enumerate(cuts):
        seq = data.seq_len
        for s, L in stages:
            if a >= s:
                seq = L
        mix = _mixture(data, phase_starts, a)
        out.append(Segment(a, cuts[k + 1] if k + 1 < len(cuts) else None, tuple(mix[s.name] for s in data.sources),
                           max(1, data.batch_size * data.seq_len // seq), seq + 1, block // (seq + 1)))
    return out


def _blocks_before(segs: list[Segment], n_sources: int) -> list[np.ndarray]:
    """Per segment: blocks each source used in all earlier segments."""
    out, used = [], np.zeros(n_sources, np.int64)
    for g in segs:
        out.append(used.copy())
        if g.end is not None:
            w = g.rows(g.batch * (g.end - g.start))
            used = used + -(-w // g.per_block)
    return out


def schedule_epochs(data: DataSpec, total_steps: int, train_tokens: dict[str, int]) -> dict[str, float]:
    """Passes over each source's training blocks that `total_steps` steps make (1.0: every window once)."""
    block = max_seq_len(data) + 1
    used = np.zeros(len(data.sources), np.float64)
    for g in segments(data, total_steps):
        end = total_steps if g.end is None else min(g.end, total_steps)
        if end > g.start:
            used += g.rows(g.batch * (end - g.start)) / g.per_block
    return {s.name: (float(used[i]) / max(1, train_tokens[s.name] // block)) for i, s in enumerate(data.sources)}


def train_tokens_of(n_tokens: int, data: DataSpec) -> int:
    """Training tokens of a source of n_tokens, about (its eval set's documents taken off)."""
    return n_tokens - held_out(n_tokens, data.eval_fraction, max_seq_len(data) + 1, data.eval_tokens)


# ---- a stateless permutation -----------------------------------------------------------------


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(*parts: int | str) -> int:
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little")


def permute(x: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of [0, n) keyed by `key`, applied to x (int64): a balanced Feistel network on the
    smallest even number of bits that holds n, cycle-walked back into [0, n)."""
    x = np.asarray(x, np.int64)
    if n <= 1:
        return np.zeros_like(x)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_key(key, r) & _M64) for r in range(FEISTEL_ROUNDS)]

    def rounds(v: np.ndarray) -> np.ndarray:
        left, right = v >> np.uint64(half), v & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    y = rounds(x.astype(np.uint64))
    out = y >= np.uint64(n)
    while out.any():  # cycle walking: the domain is at most 4n, so a few rounds on average
        y[out] = rounds(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


# ---- the stream -------------------------------------------------------------------------------


class TokenStream:
    def __init__(self, data: DataSpec, seed: int, total_steps: int, vocab_size: int | None = None,
                 workers: int | None = None):
        self.data = data
        self.seed = seed
        self.total_steps = total_steps
        self.names = [s.name for s in data.sources]
        self.max_seq_len = max_seq_len(data)
        self.block = self.max_seq_len + 1
        try:
            self.tokenizer = load_tokenizer(data.tokenizer)
        except TokenizerError as err:
            raise DataError(str(err)) from err
        workers = default_workers() if workers is None else workers
        self.eval_seq_len = eval_seq_len(data)
        self.sources = {
            s.name: load_source(s, self.tokenizer, data.eval_fraction, self.block, vocab_size, workers,
                                data.eval_tokens, self.eval_seq_len + 1)
            for s in data.sources
        }
        self.n_blocks = np.asarray([len(self.sources[n].blocks) for n in self.names], np.int64)
        self._segments = segments(data, total_steps)
        self._before = _blocks_before(self._segments, len(self.names))
        self._perm_keys = [_key(seed, "blocks", n) for n in self.names]

    @classmethod
    def from_spec(cls, spec: Spec, use_cache: bool = True, workers: int | None = None) -> "TokenStream":
        return cls(spec.data, spec.seed, spec.total_steps, spec.model.vocab_size, workers)

    # ---- schedule of the stream ----
    def _segment(self, step: int) -> int:
        g = 0
        while g + 1 < len(self._segments) and step >= self._segments[g + 1].start:
            g += 1
        return g

    def mixture_at(self, step: int) -> dict[str, float]:
        return dict(zip(self.names, self._segments[self._segment(step)].weights))

    def base_mixture(self) -> dict[str, float]:
        total = sum(s.weight for s in self.data.sources)
        return {s.name: s.weight / total for s in self.data.sources}

    def seq_len_at(self, step: int) -> int:
        return self._segments[self._segment(step)].window - 1

    def batch_size_at(self, step: int) -> int:
        return self._segments[self._segment(step)].batch

    def epochs(self, total_steps: int | None = None) -> dict[str, float]:
        steps = self.total_steps if total_steps is None else total_steps
        return schedule_epochs(self.data, steps, {n: self.sources[n].split for n in self.names})

    # ---- batches ----
    def window_starts(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, start token) of every row of `step`'s batch, in batch order: int64 [B] each."""
        return self._rows(step, 0, None)

    def _rows(self, step: int, lo: int, hi: int | None) -> tuple[np.ndarray, np.ndarray]:
        g = self._segment(step)
        seg = self._segments[g]
        B = seg.batch
        hi = B if hi is None else hi
        n0 = seg.batch * (step - seg.start)
        c0, c1 = seg.rows(n0), seg.rows(n0 + B)  # windows each source used before / after this step
        slot_ends = np.cumsum(c1 - c0)
        slots = permute(np.arange(lo, hi), B, _key(self.seed, ROW_TAG, step))  # this rank's rows' slots
        src = np.searchsorted(slot_ends, slots, side="right")
        c = c0[src] + (slots - (slot_ends[src] - (c1 - c0)[src]))  # the window's index in its segment
        block = self._before[g][src] + c // seg.per_block
        starts = np.empty(len(slots), np.int64)
        for i in range(len(self.names)):
            rows = np.nonzero(src == i)[0]
            if not len(rows):
                continue
            nb = int(self.n_blocks[i])
            epoch, local = np.divmod(block[rows], nb)
            if epoch.min() == epoch.max():  # all but the step that crosses an epoch's end
                perm = permute(local, nb, _key(self._perm_keys[i], int(epoch[0])))
            else:
                perm = np.empty_like(local)
                for e in range(int(epoch.min()), int(epoch.max()) + 1):
                    at = epoch == e
                    perm[at] = permute(local[at], nb, _key(self._perm_keys[i], e))
            phys = self.sources[self.names[i]].blocks[perm]
            starts[rows] = phys * self.block + (c[rows] % seg.per_block) * seg.window
        return src, starts

    def batch(self, step: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """Training batch of `step` (0-based): int32 [B, S+1]; with world > 1, rank's rows
        [rank*B//world, (rank+1)*B//world) of it, read without reading the others."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}) (got {rank})")
        B, window = self.batch_size_at(step), self.seq_len_at(step) + 1
        src, starts = self._rows(step, rank * B // world, (rank + 1) * B // world)
        out_BS1 = np.empty((len(src), window), np.int32)
        for i, name in enumerate(self.names):
            rows = np.nonzero(src == i)[0]
            if len(rows):
                out_BS1[rows] = self.sources[name].shards.gather(starts[rows], window)
        return out_BS1

    # ---- the fixed eval set ----
    def eval_windows(self, source: str, rows: np.ndarray) -> np.ndarray:
        """Windows `rows` (indices into the reading order) of `source`'s eval set: int32 [n, eval_seq_len + 1]."""
        es = self.sources[source].evalset
        return self.sources[source].shards.gather(es.starts_W[np.asarray(rows, np.int64)], es.window)

    def eval_plan(self, windows: int | None = None, rows: int = EVAL_ROWS) -> list[tuple[str, np.ndarray]]:
        """(source, rows) of every eval batch: each source's windows (all of them when None, else its
        stratified sample of `windows`, periodic_windows) in reading order in groups of `rows`, source
        after source in spec order. Sources of weight 0 in the base mixture are scored too (per
        source), though they do not enter the mixture."""
        out = []
        for n in self.names:
            es = self.sources[n].evalset
            idx = np.arange(es.n_windows, dtype=np.int64) if windows is None else periodic_windows(es.starts_W, windows)
            out += [(n, idx[lo:lo + rows]) for lo in range(0, len(idx), rows)]
        return out

    def eval_batch(self, source: str, rows: np.ndarray, seq_len: int | None = None) -> np.ndarray:
        """One eval batch, int32 [n, S+1]: windows `rows` of `source`; with seq_len S shorter than
        the eval windows, each window is cut into consecutive pieces of S+1 tokens (sharing their edge
        token), so a model of shorter context scores the same tokens."""
        x = self.eval_windows(source, rows)
        L = x.shape[1] - 1
        if seq_len is None or seq_len >= L:
            return x
        if L % seq_len:
            raise DataError(f"eval windows of {L} tokens cannot be cut into sequences of {seq_len}: set "
                            f"data.eval_seq_len to a multiple of every run's sequence length")
        k = L // seq_len
        idx = np.arange(k)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
        return x[:, idx].reshape(-1, seq_len + 1)

    @property
    def eval_fingerprint(self) -> str:
        """The fixed eval set's identity: every source's windows and the mixture weights."""
        return combined_fingerprint({n: self.sources[n].evalset for n in self.names}, self.base_mixture())

    def eval_summary(self) -> dict:
        """What status.json records about the eval set."""
        return {"fingerprint": self.eval_fingerprint, "seq_len": self.eval_seq_len,
                "sources": {n: {"fingerprint": st.evalset.fingerprint, "windows": st.evalset.n_windows,
                                "tokens": st.evalset.n_tokens, "held_out_tokens": st.evalset.held_tokens,
                                "train_tokens": st.split, "weight": self.base_mixture()[n]}
                            for n, st in self.sources.items()}}

    # ---- identity ----
    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"tokenizer:{self.tokenizer.digest}\n".encode())
        for n in self.names:
            st = self.sources[n]
            h.update(f"{n}:{st.digest}:{st.evalset.fingerprint}:{st.split}\n".encode())
        return h.hexdigest()[:16]

    def state(self, step: int) -> dict:
        """The data state a checkpoint records: with (seed, step) the stream is fully determined."""
        return {"seed": self.seed, "next_step": step, "fingerprint": self.fingerprint,
                "tokenizer": self.data.tokenizer}

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the token unigram distribution of the base mixture's training data:
        the loss of a model that ignores context."""
        p = np.zeros(self.tokenizer.vocab_size, np.float64)
        for n, w in self.base_mixture().items():
            counts = np.zeros(len(p), np.float64)
            st = self.sources[n]
            for lo in range(0, len(st.blocks), 4096):
                x = st.shards.gather(st.blocks[lo:lo + 4096] * st.block, st.block)
                counts += np.bincount(x.ravel(), minlength=len(p))[: len(p)]
            p += w * counts / counts.sum()
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())
