"""Tokenizers: bytes, a Hugging Face tokenizer.json, or a named preset resolving to a local file.

API
---
    tok = load_tokenizer("bytes" | "path/to/tokenizer.json" | "llama3")
    tok.vocab_size, tok.eos_id, tok.digest, tok.dtype      # uint16 below 65,536 ids, else uint32
    tok.encode_docs([b"...", ...])                         # one np.ndarray of ids per document
    check_vocab(spec)                                      # model.vocab_size >= the tokenizer's vocabulary
    train_bpe(files, vocab_size, out)                      # a byte-level BPE trained with `tokenizers`

Names. `bytes` is one token per byte (vocab 256; the document separator is byte 0, which text
never holds). A value ending in `.json` is a path to a tokenizer.json (relative to the working
directory). Any other value is a preset looked up, in order, in
    $MOE_LADDER_TOKENIZERS/NAME/tokenizer.json, $MOE_LADDER_TOKENIZERS/NAME.json,
    ~/.cache/moe-ladder/tokenizers/NAME/tokenizer.json, ~/.cache/moe-ladder/tokenizers/NAME.json,
    experiments/tokenizers/NAME.json (the tokenizers this project trained and ships).
Nothing is downloaded: a missing preset is one line naming where it was looked for and how to get
it (for llama3, Meta's licence-gated tokenizer.json from Hugging Face).

Documents end with the tokenizer's end-of-text token (the first of EOS_NAMES it has), so a
document boundary is one token in every tokenizer. A tokenizer without one is refused.

Identity. `digest` is the sha256 of the tokenizer file's bytes ("bytes" for bytes): it goes into
every shard key and the data fingerprint, so a changed file can never be mistaken for the old one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from core import env
from core.errors import InputError
from core.fsutil import atomic_write_text
from core.spec import Spec

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
PROJECT_TOKENIZERS = Path(__file__).resolve().parents[1] / "experiments" / "tokenizers"
HOW_TO_GET = {
    "llama3": "accept Meta's licence at https://huggingface.co/meta-llama/Meta-Llama-3-8B, then "
              "`huggingface-cli download meta-llama/Meta-Llama-3-8B tokenizer.json --local-dir "
              "~/.cache/moe-ladder/tokenizers/llama3`",
}


class TokenizerError(InputError):
    """A tokenizer that cannot be found or read; the message names the file."""


def search_paths(name: str) -> list[Path]:
    """Where the preset `name` is looked for, in order."""
    roots = []
    if env.path("TOKENIZERS"):
        roots.append(env.path("TOKENIZERS"))
    cache = env.path("CACHE") or Path.home() / ".cache" / "moe-ladder"
    roots.append(cache / "tokenizers")
    out = []
    for r in roots:
        out += [r / name / "tokenizer.json", r / f"{name}.json"]
    out.append(PROJECT_TOKENIZERS / f"{name}.json")
    return out


def resolve(name: str) -> Path | None:
    """The tokenizer.json file `name` stands for (None for bytes); TokenizerError when missing."""
    if name == "bytes":
        return None
    if name.endswith(".json"):
        p = Path(name).expanduser()
        if not p.is_file():
            raise TokenizerError(f"tokenizer file {p} does not exist; train one with "
                                 f"`ladder data tokenizer --corpus FILES --vocab-size N --out {p}`")
        return p.resolve()
    for p in search_paths(name):
        if p.is_file():
            return p.resolve()
    how = HOW_TO_GET.get(name, "put its tokenizer.json at the first of these paths, or train one with "
                               "`ladder data tokenizer`")
    raise TokenizerError(f"tokenizer {name!r} not found (looked for {', '.join(map(str, search_paths(name)))}); "
                         f"to get it: {how}")


@dataclass(frozen=True)
class Tokenizer:
    name: str
    path: Path | None
    vocab_size: int
    eos_id: int
    digest: str
    _hf: object = field(default=None, repr=False, compare=False)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.path is None else np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    @property
    def cuts_at_line_starts(self) -> bool:
        """Whether a document tokenized in pieces, each cut just after a newline between two
        non-space characters, gives its whole-document ids: bytes, and byte-level BPE (GPT-2's
        pre-tokenizing regex, no prefix space, no normalizer), where such a newline is a pre-token
        of its own either way. Other tokenizers get each document whole."""
        if self._hf is None:
            return True
        from tokenizers import pre_tokenizers

        pre = self._hf.pre_tokenizer
        return (self._hf.normalizer is None and isinstance(pre, pre_tokenizers.ByteLevel)
                and not pre.add_prefix_space and pre.use_regex)

    def encode_docs(self, docs: Sequence[bytes]) -> list[np.ndarray]:
        """Token ids of each document (without its end-of-text token)."""
        if self._hf is None:
            return [np.frombuffer(d.replace(b"\0", b""), np.uint8) for d in docs]
        encs = self._hf.encode_batch([d.decode("utf-8", errors="replace") for d in docs], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._hf is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=False)

    def describe(self) -> str:
        return "bytes" if self.path is None else f"{self.name} ({self.vocab_size:,} ids, {self.path})"


BYTES = Tokenizer("bytes", None, 256, 0, "bytes")


@functools.lru_cache(maxsize=16)
def _load_file(path: str, size: int, mtime_ns: int, name: str) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    raw = Path(path).read_bytes()
    try:
        hf = HFTokenizer.from_str(raw.decode())
    except Exception as err:  # the Rust side raises a bare Exception (no narrower type) for a malformed file;
        # decode a UnicodeDecodeError: nothing else runs here
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(f"tokenizer file {path} is not a valid tokenizer.json ({first})") from err
    vocab = hf.get_vocab(with_added_tokens=True)
    eos = next((vocab[t] for t in EOS_NAMES if t in vocab), None)
    if eos is None:
        raise TokenizerError(f"tokenizer file {path} has no end-of-text token (one of {', '.join(EOS_NAMES)})")
    n = max(hf.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    return Tokenizer(name, Path(path), n, int(eos), hashlib.sha256(raw).hexdigest(), hf)


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer `name` names (see the module docstring); TokenizerError names the file."""
    path = resolve(name)
    if path is None:
        return BYTES
    st = path.stat()
    return _load_file(str(path), st.st_size, st.st_mtime_ns, name)


def check_vocab(spec: Spec) -> Spec:
    """Refuse a model whose vocabulary cannot hold every id its tokenizer makes (when the file is here)."""
    try:
        tok = load_tokenizer(spec.data.tokenizer)
    except TokenizerError:
        if spec.data.tokenizer.endswith(".json"):
            raise
        return spec  # a preset the user supplies on the training machine: checked there
    if spec.model.vocab_size < tok.vocab_size:
        raise TokenizerError(f"{spec.name}: model.vocab_size {spec.model.vocab_size:,} is smaller than tokenizer "
                             f"{spec.data.tokenizer!r}'s {tok.vocab_size:,} ids ({tok.path or 'bytes'})")
    return spec


def padded_vocab(tokenizer: str, multiple: int = 128) -> int:
    """The tokenizer's vocabulary rounded up to a multiple (a matmul-friendly model.vocab_size)."""
    n = load_tokenizer(tokenizer).vocab_size
    return -(-n // multiple) * multiple


def train_bpe(files: Sequence[str | Path], vocab_size: int, out: str | Path, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE trained on `files` (text, or jsonl whose lines carry a "text" field), written
    atomically to `out`. Its id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(_texts(files), trainer=trainer)
    atomic_write_text(out, hf.to_str(pretty=False))
    return load_tokenizer(str(out))


def _texts(files: Sequence[str | Path]) -> Iterable[str]:
    for f in files:
        p = Path(f)
        if p.suffix in (".jsonl", ".ndjson"):
            with open(p, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.strip():
                        yield json.loads(line).get("text", "")
        else:
            yield p.read_text(encoding="utf-8", errors="replace")
