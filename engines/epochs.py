"""Epochs a spec makes over each source, without tokenizing anything.

    spec_epochs(spec) -> {"tokenizer", "epochs": {source: float | None}, "source_tokens": {...},
                          "basis": {source: "shards" | "manifest" | "estimate" | "missing"}}

A source's token count comes from, in order: its prepared shards (exact: `ladder data prepare`);
for the packages_* corpus parts, the corpus manifest's count under this tokenizer's sha256 (exact
for the corpus it describes: $MOE_LADDER_CORPUS/manifest.json when a corpus was built here, else
the manifest committed in experiments/corpus/, measured where that corpus was built); else an
estimate, the input bytes over ESTIMATE_BYTES_PER_TOKEN (1 for bytes). Epochs are then
engines.data.schedule_epochs: passes over the source's training windows that the run's steps,
phases and context stages make.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.spec import SourceSpec, Spec
from engines.data import schedule_epochs, train_tokens_of
from engines.shards import open_shards
from engines.sources import PACKAGE_PARTS, DataError, corpus_dir, source_files
from engines.tokenizer import Tokenizer, TokenizerError, load_tokenizer

ESTIMATE_BYTES_PER_TOKEN = 3.5
COMMITTED_MANIFESTS = Path(__file__).resolve().parents[1] / "experiments" / "corpus"


def _manifests() -> list[tuple[Path, dict]]:
    out = []
    for p in [corpus_dir() / "manifest.json", *sorted(COMMITTED_MANIFESTS.glob("*.json"))]:
        try:
            out.append((p, json.loads(p.read_text())))
        except (OSError, ValueError):
            continue
    return out


def source_tokens(source: SourceSpec, tok: Tokenizer | None) -> tuple[int | None, str]:
    """(token count, how it is known) of one source."""
    if tok is not None:
        try:
            shards = open_shards(source, tok)
        except (DataError, OSError):
            shards = None
        if shards is not None:
            return shards.n_tokens, "shards"
    if source.builtin in PACKAGE_PARTS and tok is not None:
        for path, m in _manifests():
            entry = m.get("parts", {}).get(PACKAGE_PARTS[source.builtin], {}).get("tokens", {}).get(tok.digest)
            if entry:
                return int(entry["tokens"]), f"manifest {path}"
    try:
        files = source_files(source)
    except DataError:
        if source.builtin in PACKAGE_PARTS:
            for path, m in _manifests():
                part = m.get("parts", {}).get(PACKAGE_PARTS[source.builtin])
                if part:
                    return int(part["bytes"] / ESTIMATE_BYTES_PER_TOKEN), f"estimate from {path}"
        return None, "missing"
    n_bytes = sum(p.stat().st_size for _, p in files)
    per = 1.0 if (tok is not None and tok.path is None) else ESTIMATE_BYTES_PER_TOKEN
    return int(n_bytes / per), "estimate"


def spec_epochs(spec: Spec) -> dict:
    try:
        tok = load_tokenizer(spec.data.tokenizer)
        tok_desc = spec.data.tokenizer if tok.path is None else f"{spec.data.tokenizer} ({tok.vocab_size:,} ids)"
    except TokenizerError:
        tok, tok_desc = None, f"{spec.data.tokenizer} (file not here)"
    counts, basis = {}, {}
    for s in spec.data.sources:
        counts[s.name], basis[s.name] = source_tokens(s, tok)
    known = {n: train_tokens_of(c, spec.data) for n, c in counts.items() if c is not None}
    ep = schedule_epochs(spec.data, spec.total_steps, {n: known.get(n, 1) for n in counts})
    return {"tokenizer": tok_desc, "epochs": {n: (ep[n] if n in known else None) for n in counts},
            "source_tokens": counts, "basis": basis, "max_epochs": spec.data.max_epochs}


def repeats(spec: Spec) -> dict[str, float]:
    """Sources the spec reads more than data.max_epochs times (known counts only)."""
    e = spec_epochs(spec)
    return {n: x for n, x in e["epochs"].items() if x is not None and x > spec.data.max_epochs + 1e-9}


def repeat_warning(spec: Spec) -> str | None:
    """A forecast warning when the run read some source more than once (None otherwise)."""
    over = {n: x for n, x in spec_epochs(spec)["epochs"].items() if x is not None and x > 1.0 + 1e-9}
    if not over:
        return None
    return (f"rung {spec.name} repeated its data ({', '.join(f'{n} {x:.2f} epochs' for n, x in sorted(over.items()))}): "
            "its loss measures memorisation as well as scaling")
