"""What the trainer harness refuses and survives: no silent restart over a run's history, a
damaged checkpoint found by its checksum and passed over for the newest intact one, a divergence
message that says how its checkpoint is known good, nothing allocated in proportion to the
token budget, and one file mode for every run file."""

import os
import stat

import pytest

from engines.base import DivergedError, read_metrics, read_status
from engines.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_step,
    verify_checkpoint,
)
from engines.options import EngineOptions
from engines.torch.engine import TorchEngine
from engines.torch.step import TorchStep
from engines.trainer import RunHistoryError, Trainer
from tests import cli_fork
from tests.support import tiny_spec

ONE = EngineOptions(cpu_threads=1, torch_ep="emulate")


def _train(spec, run_dir, resume=True):
    return list(TorchEngine("cpu", ONE).train(spec, run_dir, resume=resume))


def _damage(ckpt, name="model.safetensors"):
    path = ckpt / name
    data = bytearray(path.read_bytes())
    data[-4096:] = bytes(4096)  # zero 4 KiB of the arrays' data
    path.write_bytes(bytes(data))


def test_missing_checkpoints_with_metrics_refuse_naming_the_run_and_the_ways_out(tmp_path):
    import shutil

    spec = tiny_spec("hist", steps=4, checkpoint_every=2)
    _train(spec, tmp_path)
    shutil.rmtree(tmp_path / "checkpoints")
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(RunHistoryError, match=r"run 'hist' .* has 4 metrics records .* restore .*--no-resume") as err:
        _train(spec, tmp_path)
    assert "\n" not in str(err.value)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # nothing rewritten


def test_no_resume_starts_over_keeping_the_old_records_aside(tmp_path):
    spec = tiny_spec("again", steps=4, checkpoint_every=2)
    _train(spec, tmp_path)
    old = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.warns(UserWarning, match="kept in"):
        _train(spec, tmp_path, resume=False)
    kept = list(tmp_path.glob("metrics.jsonl.*.bak"))
    assert len(kept) == 1 and kept[0].read_bytes() == old
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]


def test_a_damaged_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path):
    spec = tiny_spec("damaged", steps=6, checkpoint_every=2, **{"run.keep_checkpoints": 3})
    whole = [r.loss for r in _train(spec, tmp_path / "whole")]
    run = tmp_path / "run"
    _train(spec, run)
    newest = latest_checkpoint(run)
    assert newest.name == "step_00000006"
    _damage(newest)
    with pytest.raises(CheckpointError, match=r"model.safetensors is damaged .*--no-resume"):
        verify_checkpoint(newest)  # the recovery hint is in the error
    with pytest.warns(UserWarning, match=r"step_00000006: model.safetensors is damaged.*resuming from the newest "
                                         r"intact one, .*step_00000004"):
        redone = _train(spec, run)
    assert [r.step for r in redone] == [4, 5]
    assert [r["loss"] for r in read_metrics(run)] == whole  # the same curve as the run never damaged
    assert list((run / "checkpoints").glob("damaged-step_00000006-*"))  # kept aside, never resumed from
    assert load_checkpoint(latest_checkpoint(run))[2]["step"] == 6


def test_a_resumed_run_starts_from_the_step_resume_step_reports(tmp_path):
    spec = tiny_spec("from", steps=6, checkpoint_every=2)
    for rec in TorchEngine("cpu", ONE).train(spec, tmp_path):
        if rec.step == 4:
            break
    assert resume_step(tmp_path) == 4
    assert [r.step for r in _train(spec, tmp_path)][0] == 4


def test_a_divergence_names_its_checkpoint_and_how_it_is_known_good(tmp_path):
    spec = tiny_spec("nan", steps=30, checkpoint_every=1, **{"optim.peak_lr": 1e6, "optim.grad_clip": 1e9})
    with pytest.raises(DivergedError) as err:
        _train(spec, tmp_path)
    msg = str(err.value)
    assert "last good" not in msg
    assert f"{latest_checkpoint(tmp_path)} (written by this run)" in msg and "--rerun-diverged" in msg
    assert read_status(tmp_path)["last_checkpoint_is"] == "written by this run"


def test_nothing_is_allocated_in_proportion_to_the_token_budget(tmp_path):
    import torch

    spec = tiny_spec("huge", steps=2).replace(**{"data.total_tokens": 10**15})
    assert spec.total_steps > 10**12
    trainer = Trainer(spec, tmp_path, TorchStep(spec, torch.device("cpu"), ONE), stop_after=2)
    assert [r.step for r in trainer.fit()] == [0, 1]


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_the_blockwise_learning_rates_equal_the_whole_schedule_bit_for_bit(decay):
    import numpy as np

    from core.schedule import lr_at
    from engines.trainer import LearningRates

    spec = tiny_spec("lr", steps=10007, **{"schedule.decay": decay})
    lr = LearningRates(spec)
    assert np.array_equal(np.array([lr(s) for s in range(spec.total_steps)]), lr_at(spec, np.arange(spec.total_steps)))


def test_run_files_are_written_with_one_mode(tmp_path):
    mask = os.umask(0o022)
    try:
        spec = tiny_spec("modes", steps=2, checkpoint_every=1)
        _train(spec, tmp_path)
    finally:
        os.umask(mask)
    files = [tmp_path / "status.json", tmp_path / "metrics.jsonl"]
    files += [p for d in list_checkpoints(tmp_path) for p in d.iterdir()]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o644"}


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size at tmp_path/disk (root only; skipped where mounting is not allowed)."""
    import subprocess

    mounted = []

    def mount(size: int):
        where = tmp_path / "disk"
        where.mkdir()
        got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if got.returncode != 0:
            pytest.skip(f"cannot mount a small file system here: {got.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_fails_in_one_line(tmp_path, small_disk):
    import subprocess
    import sys

    from core.spec import save_spec
    from engines.checkpoint import SPACE_MARGIN
    from engines.torch.model import init_params

    spec = tiny_spec("full", steps=4, checkpoint_every=2)
    one = sum(a.nbytes for a in init_params(spec.model, spec.seed).values()) * 3  # weights and two moments
    disk = small_disk(2 * one + SPACE_MARGIN - one // 3)  # room for step 0's checkpoint, not for step 2's too
    run = disk / "run"
    got = cli_fork.ladder("train", save_spec(spec, tmp_path / "full.yaml"), "--run-dir", run, "--quiet", timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MOE_LADDER_OPTIONS": "cpu_threads=1"})
    assert got.returncode == 2, got.stderr
    lines = [line for line in got.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "no space for checkpoint step 2" in lines[0] and "Traceback" not in got.stderr
    status = read_status(run)
    assert status["state"] == "failed" and "no space for checkpoint step 2" in status["error"]
    assert latest_checkpoint(run).name == "step_00000000"
    verify_checkpoint(latest_checkpoint(run))  # intact
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_an_edited_step_in_state_json_is_caught_and_the_run_resumes_from_the_newest_intact_one(tmp_path):
    spec = tiny_spec("edited", steps=8, checkpoint_every=2, **{"run.keep_checkpoints": 3})
    whole = [r.loss for r in _train(spec, tmp_path / "whole")]
    run = tmp_path / "run"
    for rec in TorchEngine("cpu", ONE).train(spec, run):
        if rec.step == 4:
            break
    state = latest_checkpoint(run) / "state.json"
    assert '"step": 4' in state.read_text()
    state.write_text(state.read_text().replace('"step": 4', '"step": 6'))  # skips steps 4 and 5 unless caught
    with pytest.raises(CheckpointError, match=r"state.json was changed after it was saved.*--no-resume"):
        verify_checkpoint(state.parent)
    with pytest.warns(UserWarning, match=r"step_00000004: state.json was changed.*resuming from the newest intact "
                                         r"one, .*step_00000002"):
        redone = _train(spec, run)
    assert [r.step for r in redone][0] == 2
    assert [r["step"] for r in read_metrics(run)] == list(range(8))
    assert [r["loss"] for r in read_metrics(run)] == whole
