"""The fixed eval set: the same held-out tokens for every run of an experiment.

    es = build_eval_set(name, shards, key, tokens=2**20, share=0.01, window=1025)
    es.starts_W          int64 [W]: each eval window's first token, in the fixed reading order
    es.held_H2           int64 [H, 2]: token spans [a, e) of the held-out documents (sorted)
    es.fingerprint       sha256 (16 hex) of the window length and every eval token, in order
    periodic_windows(es.starts_W, k)  # the k windows a periodic eval scores (indices into starts_W)
    train_blocks(n_tokens, block, es.held_H2)  # the training blocks (TrainBlocks) that touch no held-out document

One source's eval set is drawn once from its token shards and depends on nothing but the source's
tokens, its document index, the window length and the size asked for: not on the seed, the batch
size, the engine or the number of ranks. So every run that reads the source with that window
scores the very same tokens, and two runs are comparable exactly when their fingerprints agree.

Held out by document, across the whole source. The source's token array is cut into W strata of
equal token count (W = ceil(tokens / window), at most `share` of the source, in whole groups of GROUP = 8 windows,
at least one group). Files are laid out package by package, so strata by position spread the windows
over every part of the source in proportion to its tokens, and no package can take more than its
share. In stratum w a document is drawn uniformly among those that start there (the one covering
the stratum's middle if none does; a document already taken is skipped), and one window of
`window` tokens is taken from it at a uniform offset (from its start when it is shorter; the
window then runs on into the documents after it). Every document a window touches is held out
whole: training never reads a block that overlaps one (train_blocks). A document longer than
LONGEST_DOC windows (a long file, a book, a one-document source) counts as pieces of that length,
so one long document neither takes a large share of the training text nor makes a source with
few documents impossible to split. Randomness comes from
Philox keyed by the source's digest, so the same shards always give the same set.

Reading order. The windows are put in an order drawn from the same key (the fingerprint covers
it). The final eval scores every window in that order. A periodic eval scores a stratified sample
of k of them (periodic_windows): the windows by position cut into k strata of equal count, and from
each the one that comes first in the reading order. So the sample spreads over the whole source as
the final's windows do (every part in proportion to its tokens, not a random k that may miss or
crowd a package), and a source's periodic mean estimates its final mean; the sources are then
combined with the same weights in both (engines/trainer.score_eval). With k at least the set's
size the sample is the whole set in the reading order, so the periodic eval is the final eval.

Stored once beside the shards (eval-<key>.npz, written atomically) and rebuilt if missing or
unreadable.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.fsutil import atomic_write_bytes
from engines.shards import ShardSet

EVALSET_VERSION = 1
GROUP = 8  # windows are scored in groups of 8 (one eval batch): a set holds whole groups
MIN_WINDOWS = GROUP
LONGEST_DOC = 8  # windows: a longer document is held out in pieces of this many windows' tokens


@dataclass(frozen=True)
class EvalSet:
    source: str
    window: int  # tokens a window holds: sequence length + 1
    starts_W: np.ndarray  # int64 [W], the reading order
    held_H2: np.ndarray  # int64 [H, 2], held-out document spans [a, e), sorted, disjoint
    fingerprint: str

    @property
    def n_windows(self) -> int:
        return len(self.starts_W)

    @property
    def n_tokens(self) -> int:
        return self.n_windows * self.window

    @property
    def held_tokens(self) -> int:
        return int((self.held_H2[:, 1] - self.held_H2[:, 0]).sum()) if len(self.held_H2) else 0


def eval_windows(n_tokens: int, tokens: int, share: float, window: int) -> int:
    """Windows of a source's eval set: tokens / window, at most `share` of the source, in whole
    groups of GROUP, at least one group."""
    want = math.ceil(tokens / window)
    cap = int(share * n_tokens) // window
    return max(MIN_WINDOWS, min(want, cap) // GROUP * GROUP)


def _philox(key: int, tag: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([key & ((1 << 63) - 1), tag])))


def _digest_key(*parts) -> int:
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little")


def pieces(doc_ends: np.ndarray, longest: int) -> np.ndarray:
    """Document ends with every document longer than `longest` tokens cut into pieces of at most
    that many (a long file, a book: held out piece by piece rather than whole)."""
    ends = np.asarray(doc_ends, np.int64)
    begins = np.concatenate([[0], ends[:-1]])
    cuts = [np.arange(b + longest, e, longest, dtype=np.int64) for b, e in zip(begins, ends) if e - b > longest]
    return np.unique(np.concatenate([ends] + cuts)) if cuts else ends


def select(doc_ends: np.ndarray, n_tokens: int, n_windows: int, window: int, key: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts_W in reading order, held_H2): the windows and the document spans they hold out."""
    ends = pieces(doc_ends, LONGEST_DOC * window)
    begins = np.concatenate([[0], ends[:-1]])
    rng = _philox(key, 1)
    edges = np.linspace(0, n_tokens - window, n_windows + 1).astype(np.int64)  # strata of window starts
    taken: set[int] = set()
    starts = []
    for w in range(n_windows):
        lo, hi = int(edges[w]), max(int(edges[w + 1]), int(edges[w]) + 1)
        d0 = int(np.searchsorted(begins, lo, side="left"))
        d1 = int(np.searchsorted(begins, hi, side="left"))  # documents starting in [lo, hi)
        cands = [d for d in range(d0, d1) if d not in taken]
        if not cands:  # a long document covers the stratum: the one at its middle
            mid = (lo + hi) // 2
            d = int(np.searchsorted(ends, mid, side="right"))
            if d >= len(ends) or d in taken:
                continue
            cands = [d]
        d = cands[int(rng.integers(len(cands)))]
        a, e = int(begins[d]), int(ends[d])
        room = e - a - window
        s = a + int(rng.integers(room + 1)) if room > 0 else a
        s = min(s, n_tokens - window)
        starts.append(s)
        last = int(np.searchsorted(ends, s + window - 1, side="right"))  # the document holding the last token
        first = int(np.searchsorted(ends, s, side="right"))
        taken.update(range(first, min(last, len(ends) - 1) + 1))
    starts_W = np.asarray(starts, np.int64)
    order = _philox(key, 2).permutation(len(starts_W))
    docs = np.asarray(sorted(taken), np.int64)
    held = np.stack([begins[docs], ends[docs]], axis=1) if len(docs) else np.zeros((0, 2), np.int64)
    return starts_W[order], _merge(held)


def periodic_windows(starts_W: np.ndarray, k: int) -> np.ndarray:
    """Indices into the reading order of the k windows a periodic eval scores, ascending: the
    windows sorted by start cut into k strata of (nearly) equal count, from each the one first in
    the reading order. Every window (arange) when k covers the set."""
    n = len(starts_W)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    by_pos = np.argsort(np.asarray(starts_W, np.int64), kind="stable")  # reading-order indices by position
    return np.sort(np.asarray([s.min() for s in np.array_split(by_pos, k)], np.int64))


def _merge(spans_H2: np.ndarray) -> np.ndarray:
    if not len(spans_H2):
        return spans_H2.reshape(0, 2)
    out = [list(spans_H2[0])]
    for a, e in spans_H2[1:]:
        if a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([a, e])
    return np.asarray(out, np.int64)


class TrainBlocks:
    """The training blocks of a source: indices of the blocks [b*block, (b+1)*block) that lie in
    it and touch no held-out span, in order, held as the few excluded indices (memory does not
    grow with the source). blocks[i] is the i-th training block's index (i an int array or slice)."""

    def __init__(self, n_blocks: int, excluded: np.ndarray):
        self.excluded = np.unique(np.asarray(excluded, np.int64))
        self.excluded = self.excluded[(self.excluded >= 0) & (self.excluded < n_blocks)]
        self.n = n_blocks - len(self.excluded)
        self._shift = self.excluded - np.arange(len(self.excluded), dtype=np.int64)  # non-decreasing

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i) -> np.ndarray:
        local = np.arange(self.n, dtype=np.int64)[i] if isinstance(i, slice) else np.asarray(i, np.int64)
        return local + np.searchsorted(self._shift, local, side="right")

    def __mul__(self, k: int) -> np.ndarray:
        return self[:] * k


def train_blocks(n_tokens: int, block: int, held_H2: np.ndarray) -> TrainBlocks:
    """The training blocks of a source of n_tokens: those that touch no held-out span."""
    spans = np.asarray(held_H2, np.int64).reshape(-1, 2)
    ranges = [np.arange(a // block, (e - 1) // block + 1, dtype=np.int64) for a, e in spans if e > a]
    return TrainBlocks(n_tokens // block, np.concatenate(ranges) if ranges else np.zeros(0, np.int64))


def fingerprint_of(shards: ShardSet, starts_W: np.ndarray, window: int) -> str:
    h = hashlib.sha256(f"evalset:v{EVALSET_VERSION}:window={window}\n".encode())
    for lo in range(0, len(starts_W), 4096):
        h.update(shards.gather(starts_W[lo:lo + 4096], window).astype(np.int32).tobytes())
    return h.hexdigest()[:16]


def build_eval_set(name: str, shards: ShardSet, tokens: int, share: float, window: int) -> EvalSet:
    """The source's eval set (read from beside its shards, or drawn and stored there)."""
    n = shards.n_tokens
    n_w = eval_windows(n, tokens, share, window)
    key = _digest_key("evalset", EVALSET_VERSION, shards.digest, n_w, window)
    path = Path(shards.dir) / f"eval-{key:016x}.npz"
    try:
        with np.load(path) as z:
            return EvalSet(name, window, z["starts"].astype(np.int64), z["held"].astype(np.int64), str(z["fingerprint"]))
    except (OSError, ValueError, KeyError):
        pass
    starts_W, held_H2 = select(shards.doc_ends(), n, n_w, window, key)
    fp = fingerprint_of(shards, starts_W, window)
    buf = io.BytesIO()
    np.savez(buf, starts=starts_W, held=held_H2, fingerprint=np.asarray(fp))
    try:
        atomic_write_bytes(path, buf.getvalue())
    except OSError:  # a read-only cache still evaluates: the set is drawn again next time
        pass
    return EvalSet(name, window, starts_W, held_H2, fp)


def combined_fingerprint(sets: dict[str, EvalSet], weights: dict[str, float]) -> str:
    """One experiment's eval fingerprint: every source's set and the mixture weights that combine them."""
    h = hashlib.sha256()
    for n in sorted(sets):
        h.update(f"{n}:{sets[n].fingerprint}:{weights.get(n, 0.0):.12g}\n".encode())
    return h.hexdigest()[:16]
