"""A small byte-level BPE the test suite trains itself (no download, well under a second)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from engines.tokenizer import train_bpe

TRAIN_FILES = ("argparse.py", "textwrap.py", "string.py", "shlex.py")


def build_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_bpe([stdlib / f for f in TRAIN_FILES], vocab_size, out)
    return out
