"""Every torch compute path (the reference forward, the fast forward, expert parallel over
processes, the FSDP2 mesh) gives on the CPU the per-step values it gave before they shared one
module tree (tests/engines/reference/paths.json, made by tests/engines/paths_driver.py). The
process paths run in a real subprocess that forks gloo ranks.

On the CPU the values were recorded on they are equal bit for bit. Another CPU's float32 kernels
(MKL and ATen pick code by vendor and vector width: AVX2, AVX-512) round sums differently, by up
to 2e-6 relative on an AMD EPYC with AVX-512; so counts, drops, steps and learning rates must be
equal and every other value within 1e-5 relative, well under what a changed computation moves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.paths_driver import DISPATCHERS, PATHS, REFERENCE, run

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
    assert process_runs["dispatchers"] == {"ep2-capacity": "PooledWave", "ep2-dropless": "Ragged",
                                           "mesh-dp2-ep2-capacity": "MeshPooledWave",
                                           "mesh-dp1-ep2-dropless": "MeshRagged"}


def test_the_recorded_paths_differ_where_their_specs_do():
    """The pins cannot pass vacuously: each run trained (losses move), capacity runs dropped, and
    the EP and mesh runs of one spec agree to float rounding without being the same record."""
    for name in PATHS:
        losses = [r["loss"] for r in EXPECTED[name]]
        assert len(set(losses)) == len(losses), name
        drops = sum(r["drop_frac_send"] + r["drop_frac_recv"] for r in EXPECTED[name])
        assert (drops > 0) == ("capacity" in name), name
    ep, mesh = EXPECTED["ep2-capacity"], EXPECTED["mesh-dp2-ep2-capacity"]
    assert ep != mesh and all(abs(a["loss"] - b["loss"]) < 1e-4 for a, b in zip(ep, mesh))
