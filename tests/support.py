"""What several test files share and is not a fixture: the suite's XLA flag, the tiny specs, the
tolerance of a refitted forecast. (tests/conftest.py holds the fixtures and imports from here.)"""

from __future__ import annotations

import os

from ladder.presets import micro_spec

# XLA's CPU backend without LLVM's optimisation passes (tests/conftest.py sets it for the suite)
OPT_FLAG = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a subprocess: the given flags after the suite's (OPT_FLAG)."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


# A micro spec made smaller still: 128 tokens a step, evaluation only at the end.
TINY = {"data.seq_len": 32, "data.batch_size": 4, "run.eval_every": 10**6, "run.eval_batches": 1}


def tiny_changes(steps: int = 30, checkpoint_every: int = 10, **changes) -> dict:
    return {**TINY, "data.total_tokens": 32 * 4 * steps, "run.checkpoint_every": checkpoint_every, **changes}


def tiny_spec(name: str = "tiny", steps: int = 30, checkpoint_every: int = 10, **changes):
    return micro_spec(name, **tiny_changes(steps, checkpoint_every, **changes))


# A forecast refitted from committed runs against the committed one (tests/analysis/test_h200_ladder.py says why)
FIT_RTOL, FIT_ATOL = 1e-6, 1e-9
