"""`ladder data ...`: train a tokenizer, build the offline corpus, prepare token shards."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Optional

import typer

from core.spec import Spec, load_spec
from ladder.errors import LadderError
from engines.corpus import build
from engines.data import default_workers
from engines.shards import open_shards, prepare
from engines.tokenizer import check_vocab, load_tokenizer, train_bpe
from ladder.experiment import check_engine, load_experiment

data_app = typer.Typer(help="Tokenizers, the offline corpus and pre-tokenized shards.", no_args_is_help=True)


def specs_of(target: str) -> list[Spec]:
    """The specs of an experiment file (rungs, hero and extras) or of one spec file."""
    if target.endswith((".yaml", ".yml", ".json")):
        specs = [check_engine(load_spec(target))]
    else:
        specs = load_experiment(target).all_specs()
    return [check_vocab(s) for s in specs]


@data_app.command("tokenizer")
def tokenizer_cmd(
    corpus: List[Path] = typer.Option(..., "--corpus", help="text or jsonl files (a \"text\" field a line); repeat it"),
    vocab_size: int = typer.Option(..., "--vocab-size", help="ids in the vocabulary, <|endoftext|> included"),
    out: Path = typer.Option(..., "--out", help="the tokenizer.json to write"),
    min_frequency: int = typer.Option(2, "--min-frequency"),
) -> None:
    """Train a byte-level BPE with `tokenizers` and write its tokenizer.json."""
    files = []
    for c in corpus:
        found = sorted(p for p in c.parent.glob(c.name) if p.is_file()) if any(ch in str(c) for ch in "*?[") else [c]
        if not found or not all(p.is_file() for p in found):
            raise LadderError(f"--corpus {c}: no such file")
        files += found
    if vocab_size < 257:
        raise LadderError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes + <|endoftext|>)")
    t0 = time.time()
    tok = train_bpe(files, vocab_size, out, min_frequency)
    mb = sum(p.stat().st_size for p in files) / 1e6
    print(f"{out}: byte-level BPE, {tok.vocab_size:,} ids, trained on {len(files)} files ({mb:.1f} MB) "
          f"in {time.time() - t0:.0f} s; sha256 {tok.digest[:16]}")


@data_app.command("corpus")
def corpus_cmd(
    out: Path = typer.Option(..., "--out", help="corpus directory (the packages_* sources read $MOE_LADDER_CORPUS)"),
    tokenizer: List[Path] = typer.Option([], "--tokenizer", help="count tokens under this tokenizer.json"),
    native: bool = typer.Option(True, "--native/--no-native", help="include C, C++ and CUDA sources"),
) -> None:
    """Build the offline corpus from installed packages (engines.corpus)."""
    for t in tokenizer:
        if not t.is_file():
            raise LadderError(f"--tokenizer {t}: no such file")
    build(out, [str(t) for t in tokenizer], native=native)


@data_app.command("prepare")
def prepare_cmd(
    target: str = typer.Argument(..., help="experiment file (or a spec YAML/JSON)"),
    workers: int = typer.Option(0, "--workers", help="tokenizing processes (default: the machine's cores)"),
    rebuild: bool = typer.Option(False, "--rebuild", help="tokenize again from scratch"),
    only: Optional[str] = typer.Option(None, "--only", help="regex over spec names"),
) -> None:
    """Tokenize every source of the specs once into memory-mapped shards (reused across specs)."""
    import re

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    specs = [s for s in specs_of(target) if not only or re.search(only, s.name)]
    jobs: dict[tuple, tuple] = {}  # one job per (source origin, tokenizer); the strictest vocabulary limit
    for s in specs:
        tok = load_tokenizer(s.data.tokenizer)
        for src in s.data.sources:
            key = (src.model_dump_json(exclude={"name", "weight"}), tok.digest)
            limit = min(s.model.vocab_size, jobs[key][2]) if key in jobs else s.model.vocab_size
            jobs[key] = (src, tok, limit)
    n_workers = workers or default_workers()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), disable=not os.isatty(2)) as bar:
        for src, tok, limit in jobs.values():
            task = bar.add_task(f"{src.name} ({tok.name})", total=None)
            t0 = time.time()
            first: list[int] = []

            def progress(done: int, total: int, task=task, first=first) -> None:
                if not first:
                    first.append(done)  # bytes already done before this run (resumed parts)
                bar.update(task, completed=done, total=total)

            shards = prepare(src, tok, workers=n_workers, progress=progress, vocab_limit=limit, rebuild=rebuild)
            dt = time.time() - t0
            new = shards.index["input_bytes"] - (first[0] if first else 0)
            speed = f", {new / 1e6 / dt:.1f} MB/s over {n_workers} workers" if new > 0 and dt > 0 else " (already prepared)"
            bar.console.print(f"{src.name}: {shards.n_tokens:,} tokens, {shards.n_docs:,} documents, "
                              f"{len(shards.parts)} {shards.index['dtype']} shards in {shards.dir}{speed}")


@data_app.command("verify")
def verify_cmd(
    target: str = typer.Argument(..., help="experiment file (or a spec YAML/JSON)"),
    only: Optional[str] = typer.Option(None, "--only", help="regex over spec names"),
) -> None:
    """Hash every shard of the specs' sources again against the digests recorded when they were made."""
    import re

    specs = [s for s in specs_of(target) if not only or re.search(only, s.name)]
    seen: set[tuple] = set()
    for s in specs:
        tok = load_tokenizer(s.data.tokenizer)
        for src in s.data.sources:
            key = (src.model_dump_json(exclude={"name", "weight"}), tok.digest)
            if key in seen:
                continue
            seen.add(key)
            shards = open_shards(src, tok)
            if shards is None:
                raise LadderError(f"data source {src.name!r} ({tok.name}) is not prepared; run `ladder data prepare {target}`")
            shards.verify()
            print(f"{src.name}: {len(shards.parts)} shards, {shards.n_tokens:,} tokens match their sha256 ({shards.dir})")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
