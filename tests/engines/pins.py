"""Comparing a run's per-step values with a recorded pin (tests/engines/reference/*.json).

On the CPU a pin was recorded on, the values are equal bit for bit. Another CPU's float32 kernels
(MKL, oneDNN, ATen and XLA pick their code by vendor and vector width: AVX2, AVX-512) round sums
differently, by up to 2e-6 relative on an AMD EPYC with AVX-512; so steps, learning rates, drops
and loads must be equal and every other float within 1e-5 relative, well under what a changed
computation moves."""

from __future__ import annotations

import math

EXACT = ("step", "lr", "drop_frac_send", "drop_frac_recv", "expert_load_max")


def same_steps(got: list[dict], expected: list[dict]) -> bool:
    """The records hold the same steps and keys, the exact keys equal, every other float within
    1e-5 relative (float32 rounding on another CPU; bit for bit on the recording one)."""
    if len(got) != len(expected) or any(g.keys() != e.keys() for g, e in zip(got, expected)):
        return False
    for g, e in zip(got, expected):
        for k, want in e.items():
            have = g[k]
            if k in EXACT or not isinstance(want, float) or not isinstance(have, float):
                if have != want:
                    return False
            elif not math.isclose(have, want, rel_tol=1e-5, abs_tol=1e-9):
                return False
    return True
