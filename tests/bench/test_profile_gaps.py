"""bench/profile_h200.py's gap table finds the stretches where nothing ran on the profiled
timeline. Checked on real torch.profiler events of the CPU timeline (the GPU's cannot be
recorded here): a 30 ms sleep between two matmuls is the longest gap, and no other is listed."""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from profile_h200 import gap_table  # noqa: E402


def test_a_sleep_between_two_ops_is_the_gap_listed():
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(a, a)
        time.sleep(0.03)
        torch.mm(a, a)
    # the CPU ops play the kernels: the outermost ones only, so nested ops do not count twice
    events = [e for e in prof.events() if e.cpu_parent is None]
    lines = gap_table(events, torch.autograd.DeviceType.CPU, steps=1, top=5, min_us=10_000)
    rows = [l for l in lines if l.startswith("| ") and not l.startswith("| gap")]
    assert len(rows) == 1
    gap_ms = float(rows[0].split("|")[1])
    assert 29 <= gap_ms <= 60 and "aten::mm" in rows[0]
