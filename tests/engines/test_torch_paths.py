"""Every torch compute path (the one-device step with the reference kernels and with the default
ones, the layout's step module over
processes: expert parallel alone and a data x expert mesh) gives on the CPU the per-step values
recorded in tests/engines/reference/paths.json (made by tests/engines/paths_driver.py). The
process paths run in a real subprocess that forks gloo ranks.

Bit for bit on the CPU they were recorded on, to float32 rounding on others (tests/engines/pins.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.paths_driver import DISPATCHERS, PATHS, REFERENCE, run
from tests.engines.pins import same_steps

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = json.loads(REFERENCE.read_text())
IN_PROCESS = [n for n, (_, (kind, _)) in PATHS.items() if kind in ("reference", "fast")]
PROCESSES = [n for n in PATHS if n not in IN_PROCESS]


@pytest.fixture(scope="module")
def process_runs() -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.engines.paths_driver", *PROCESSES], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_comparison_fails_on_a_changed_value():
    rec = EXPECTED["reference-dropless"]
    assert same_steps(rec, rec)
    moved = [dict(r) for r in rec]
    moved[3]["loss"] *= 1 + 1e-4
    assert not same_steps(moved, rec)
    dropped = [dict(r) for r in rec]
    dropped[2]["drop_frac_send"] = 1e-7
    assert not same_steps(dropped, rec)
    assert not same_steps(rec[:-1], rec)


@pytest.mark.parametrize("name", IN_PROCESS)
def test_one_device_path_steps_equal_the_recorded_ones(name):
    assert same_steps(run(name), EXPECTED[name])
    assert DISPATCHERS[name] == ("Capacity" if "capacity" in name else "Dropless")


@pytest.mark.slow
@pytest.mark.parametrize("name", PROCESSES)
def test_process_path_steps_equal_the_recorded_ones(process_runs, name):
    assert same_steps(process_runs["values"][name], EXPECTED[name])


@pytest.mark.slow
def test_each_process_path_ran_and_recorded_its_own_dispatcher(process_runs):
    assert process_runs["dispatchers"] == {"dp1-ep2-capacity": "PooledWave", "dp1-ep2-dropless": "Ragged",
                                           "dp2-ep2-capacity": "PooledWave"}


def test_the_recorded_paths_differ_where_their_specs_do():
    """The pins cannot pass vacuously: each run trained (losses move), capacity runs dropped, and
    the dp1 and dp2 runs of one spec agree to float rounding without being the same record."""
    for name in PATHS:
        losses = [r["loss"] for r in EXPECTED[name]]
        assert len(set(losses)) == len(losses), name
        drops = sum(r["drop_frac_send"] + r["drop_frac_recv"] for r in EXPECTED[name])
        assert (drops > 0) == ("capacity" in name), name
    ep, mesh = EXPECTED["dp1-ep2-capacity"], EXPECTED["dp2-ep2-capacity"]
    assert ep != mesh and all(abs(a["loss"] - b["loss"]) < 1e-4 for a, b in zip(ep, mesh))
