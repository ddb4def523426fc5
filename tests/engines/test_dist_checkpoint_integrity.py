"""Sharded checkpoints of a real 2-process mesh (gloo, dp1 x ep2) are checked before use: a
flipped byte, a truncated or missing file and an edited state.json are refused by the export
command in one line (exit 2, nothing written), a resumed mesh run passes over a damaged checkpoint
for the newest intact one and ends as the uninterrupted run, and a crafted .metadata is never
unpickled, even with its checksum recorded."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.spec import save_spec
from engines.base import read_metrics
from engines.checkpoint import CheckpointError, write_state
from engines.torch.parallel.checkpoint import SafeReader, list_sharded, read_full
from ladder.presets import micro_spec
from tests.cli_fork import ladder_many
from tests.engines.fork_ranks import cpu_env, drive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPEC = micro_spec("sealed", **{"data.total_tokens": 6 * 64 * 8, "run.checkpoint_every": 2, "run.eval_every": 100,
                               "run.keep_checkpoints": 3})


def _args(root: Path, run: str, *extra: str) -> list[str]:
    return [str(root / "spec.yaml"), "--run-dir", str(root / run), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sealed")
    save_spec(SPEC, root / "spec.yaml")
    codes = drive("engines.torch.parallel.train", [[2, _args(root, "full")], [2, _args(root, "half", "--steps", "4")]],
                  join_s=240, timeout=600)
    assert codes == [[0, 0], [0, 0]]
    return root


def _copy(runs: Path, tmp_path: Path, run: str = "full") -> Path:
    return Path(shutil.copytree(runs / run, tmp_path / run))


def _flip(offset: float):
    def damage(run: Path) -> None:
        shard = list_sharded(run)[-1] / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[int(len(data) * offset)] ^= 0x01
        shard.write_bytes(bytes(data))
    return damage


def _truncate(run: Path) -> None:
    shard = list_sharded(run)[-1] / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


def _remove(name: str):
    return lambda run: (list_sharded(run)[-1] / name).unlink()


def _edit_step(run: Path) -> None:
    path = list_sharded(run)[-1] / "state.json"
    path.write_text(path.read_text().replace('"step": 6', '"step": 8'))


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _craft_metadata(run: Path) -> None:
    """A pickle that would run a command, its digest re-recorded in state.json as an attacker would."""
    from engines.checkpoint import sha256_file

    ckpt = list_sharded(run)[-1]
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(run.parent / "ran")))
    state = json.loads((ckpt / "state.json").read_text())
    state["sha256"][".metadata"] = sha256_file(ckpt / ".metadata")
    write_state(ckpt, state)


# each case: a copy of the full run, damaged so; exported once for the module (one process that
# imports torch, a fork per case, each the process `python -m engines.torch.parallel.checkpoint` is)
DAMAGES = {"intact": lambda run: None, "flip0.1": _flip(0.1), "flip0.5": _flip(0.5), "flip0.9": _flip(0.9),
           "truncated": _truncate, "missing__0_0.distcp": _remove("__0_0.distcp"),
           "missing.metadata": _remove(".metadata"), "edited_step": _edit_step, "crafted_metadata": _craft_metadata}


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """{case: (its run dir, the export's CompletedProcess)}."""
    cases = {}
    for name, damage in DAMAGES.items():
        run = _copy(runs, tmp_path_factory.mktemp(name))
        damage(run)
        cases[name] = run
    done = ladder_many([([str(run)], ROOT) for run in cases.values()], env=cpu_env(), parallel=2, timeout=300,
                       module="engines.torch.parallel.checkpoint")
    return {name: (run, proc) for (name, run), proc in zip(cases.items(), done)}


def _refused(exported, case: str, *needles: str) -> None:
    run_dir, proc = exported[case]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (run_dir / "checkpoints").exists()  # nothing exported


def test_every_file_of_a_sharded_checkpoint_has_its_sha256_in_the_sealed_state(runs, exported):
    newest = list_sharded(runs / "full")[-1]
    state = json.loads((newest / "state.json").read_text())
    assert sorted(state["sha256"]) == sorted(f.name for f in newest.iterdir() if f.name != "state.json")
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(state["sha256"])
    assert "state_sha256" in state
    run_dir, proc = exported["intact"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("offset", [0.1, 0.5, 0.9])
def test_a_flipped_byte_in_a_shard_is_refused_by_export_in_one_line(exported, offset):
    _refused(exported, f"flip{offset}", "__0_0.distcp is damaged", "step_00000006")


def test_a_truncated_shard_is_refused_in_one_line(exported):
    _refused(exported, "truncated", "__1_0.distcp is damaged")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_missing_file_is_refused_in_one_line(exported, name):
    _refused(exported, f"missing{name}", f"{name} is missing")


def test_an_edited_step_in_state_json_is_refused(exported):
    _refused(exported, "edited_step", "state.json was changed after it was saved")


def test_a_resumed_mesh_run_passes_over_a_damaged_checkpoint_and_ends_as_the_uninterrupted_run(runs, tmp_path):
    run = _copy(runs, tmp_path, "half")
    assert [d.name for d in list_sharded(run)] == ["step_00000000", "step_00000002", "step_00000004"]
    shard = list_sharded(run)[-1] / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "tests.engines.fork_ranks", "engines.torch.parallel.train",
                           json.dumps([[2, [str(runs / "spec.yaml"), "--run-dir", str(run), "--device", "cpu"]]]),
                           "240"], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "CODES [[0, 0]]" in proc.stdout, proc.stderr[-3000:]
    assert "step_00000004: __1_0.distcp is damaged" in proc.stderr and "step_00000002" in proc.stderr
    assert list((run / "sharded").glob("damaged-step_00000004-*"))  # kept aside, never resumed from
    whole, redone = read_metrics(runs / "full"), read_metrics(run)
    assert [r["step"] for r in redone] == list(range(6))
    assert [r["loss"] for r in redone] == [r["loss"] for r in whole]
    got, _, _ = read_full(list_sharded(run)[-1])
    ref, _, _ = read_full(list_sharded(runs / "full")[-1])
    for k in ref:
        assert np.array_equal(got[k], ref[k]), k


def test_a_crafted_metadata_is_never_unpickled_even_with_a_recorded_checksum(exported):
    _refused(exported, "crafted_metadata", ".metadata: refused, not read", "posix.system")
    run, _ = exported["crafted_metadata"]
    marker = run.parent / "ran"
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused"):
        SafeReader(str(list_sharded(run)[-1])).read_metadata()
    assert not marker.exists()
