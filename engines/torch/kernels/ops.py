"""Triton for the fast path's kernels (None where it is not installed), and their registration as
custom ops that torch.compile traces into."""

from __future__ import annotations

import warnings
from typing import Callable

try:  # Triton ships with CUDA builds of torch; the CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = tl = None


def register_triton_ops(owner: str, fallback: str, ops: dict[str, Callable]) -> bool:
    """torch.library.triton_op(name, mutates_args=())(fn) for each name -> fn (the schema comes from
    fn's annotations). Where this torch cannot register them: False, and a warning that names
    `owner` and what runs instead (`fallback`)."""
    import torch

    try:
        for name, fn in ops.items():
            torch.library.triton_op(name, mutates_args=())(fn)
    except Exception as err:  # pragma: no cover - depends on the installation
        warnings.warn(f"{owner}: Triton ops not registered ({err}); {fallback}")
        return False
    return True
