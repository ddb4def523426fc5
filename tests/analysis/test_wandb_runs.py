"""W&B runs as metric sources, tested on runs the real `wandb` library writes in offline mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from analysis.runs.names import load_metric_names  # noqa: E402
from analysis.runs.metrics import MetricsError, check_spec_matches, tokens_from_spec  # noqa: E402
from analysis.runs.wandb_runs import BLOCK, HEADER, RECORD, read_log_records, resolve_wandb_log  # noqa: E402
from analysis.runs.sources import open_source  # noqa: E402
from ladder.presets import micro_spec  # noqa: E402
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def write_run(tmp: Path, *args: str) -> Path:
    """A finished offline run written by wandb; its run directory."""
    out = subprocess.run([sys.executable, "-m", "tests.analysis.wandb_writer", str(tmp), *args],
                         capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


def ladder(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return cli_fork.ladder(*args, cwd=REPO, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("wb"), "--steps", "200", "--spike", "120", "--blowup", "160")


def test_an_offline_run_reads_under_olmo_cores_names_in_its_own_step_count(spiky_run):
    src = open_source(f"wandb:{spiky_run}", names=load_metric_names("olmo-core"))
    df = src.read()
    assert list(df["step"][:3]) == [1, 2, 3] and df["step"].iloc[-1] == 200
    assert {"loss", "grad_norm", "lr", "tokens", "z_loss"} <= set(df.columns)
    assert df.attrs["first_step"] == 1
    assert df["tokens"].iloc[0] == 8 * 64
    assert src.status()["state"] == "finished"


def test_a_wandb_directory_resolves_to_its_latest_run(spiky_run):
    assert resolve_wandb_log(spiky_run.parent) == resolve_wandb_log(spiky_run)  # wandb/ -> latest-run


def test_compare_flags_the_planted_spike_and_the_grad_norm_blowup_and_exits_3(spiky_run):
    out = ladder("compare", f"wandb:{spiky_run}", "--metric-names", "olmo-core", "--json")
    assert out.returncode == 3, out.stderr
    rep = json.loads(out.stdout)
    first = {f["kind"]: (f["severity"], f["first_step"]) for f in rep["flags"]}
    assert first["loss_spike"][1] == 120  # the step the writer planted it at, in OLMo-core's count
    assert first["grad_norm_high"][0] == "critical" and 160 <= first["grad_norm_high"][1] <= 175
    assert rep["source"]["kind"] == "wandb-dir"


def test_a_log_cut_anywhere_reads_its_complete_records_and_resumes_to_the_same_records(spiky_run, tmp_path):
    log = resolve_wandb_log(spiky_run)
    data = log.read_bytes()
    whole, end = read_log_records(log)
    assert end == len(data) and len(whole) > 200
    part = tmp_path / "run-cut.wandb"
    for cut in (7, 100, len(data) // 3, len(data) // 2 + 13, len(data) - 5):
        part.write_bytes(data[:cut])
        first, offset = read_log_records(part)
        assert offset <= cut and whole[: len(first)] == first
        part.write_bytes(data)  # the writer carries on
        rest, end2 = read_log_records(part, offset)
        assert first + rest == whole and end2 == len(data)


def _flipped(log: Path, at: int, dest: Path) -> Path:
    data = bytearray(log.read_bytes())
    data[at] ^= 0xFF
    dest.parent.mkdir(exist_ok=True)
    dest.write_bytes(bytes(data))
    return dest


def _record_headers(data: bytes) -> list[int]:
    """The byte offsets of every record header in a well-formed log (LevelDB's log format)."""
    pos, out = HEADER.size, []
    while True:
        if BLOCK - pos % BLOCK < RECORD.size:
            pos += BLOCK - pos % BLOCK
        if pos + RECORD.size > len(data):
            return out
        out.append(pos)
        pos += RECORD.size + RECORD.unpack_from(data, pos)[1]


def test_a_corrupt_byte_before_the_last_record_is_an_error_naming_the_file(spiky_run, tmp_path):
    """Each byte of every record header but the last (checksum, length, type), every block's zero
    padding and a stride through the bodies: the damage is an error, never records silently
    dropped or a tail left for a later read. The one exception is a length that now points past the
    end of the file but not past its block: that is what a record still being written looks like."""
    log = resolve_wandb_log(spiky_run)
    data = log.read_bytes()
    heads = _record_headers(data)
    assert len(heads) > 200
    padding = [b - d for b in range(BLOCK, len(data), BLOCK) for d in range(1, RECORD.size)
               if BLOCK - (b - d) % BLOCK < RECORD.size and not data[b - d]]

    def unfinished(h: int, k: int) -> bool:  # the flipped length byte makes the record run past EOF
        if k not in (4, 5):
            return False
        length = RECORD.unpack_from(data, h)[1] ^ (0xFF << (8 * (k - 4)))
        return h + RECORD.size + length > len(data) and RECORD.size + length <= BLOCK - h % BLOCK

    spots = {h + k for h in heads[:-1] for k in range(RECORD.size) if not unfinished(h, k)}
    spots |= set(range(HEADER.size, heads[-1], 211))
    bad = tmp_path / "bad" / "run-x.wandb"
    for at in sorted(spots | set(padding)):
        _flipped(log, at, bad)
        with pytest.raises(MetricsError, match="run-x.wandb"):
            read_log_records(bad)


def test_a_corrupt_record_is_one_clear_error_naming_the_file(spiky_run, tmp_path):
    log = resolve_wandb_log(spiky_run)
    bad = _flipped(log, log.stat().st_size // 2, tmp_path / "bad" / "run-x.wandb")
    out = ladder("compare", f"wandb:{bad.parent}", "--metric-names", "olmo-core")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_run_that_exits_nonzero_reads_as_failed(tmp_path):
    run = write_run(tmp_path, "--steps", "20", "--fail")
    src = open_source(f"wandb:{run}", names=load_metric_names("olmo-core"))
    src.read()
    assert src.status() == {"state": "failed", "exit_code": 1}


def test_the_last_step_of_a_stack_counting_from_1_matches_its_spec_one_shot(tmp_path):
    spec = micro_spec("s400", **{"data.total_tokens": 64 * 8 * 400})
    (tmp_path / "s.yaml").write_text(spec.to_yaml())
    run = write_run(tmp_path, "--steps", "400", "--spec", str(tmp_path / "s.yaml"))
    src = open_source(f"wandb:{run}", names=load_metric_names("olmo-core"))
    df = src.read()
    check_spec_matches(spec, df)  # step 400 of a 400-step spec, LR at each step
    assert tokens_from_spec(df.drop(columns="tokens"), spec)["tokens"].iloc[-1] == spec.data.total_tokens
    out = ladder("compare", f"wandb:{run}", "--metric-names", "olmo-core", "--spec", str(tmp_path / "s.yaml"), "--json")
    assert out.returncode in (0, 3), out.stderr
    assert json.loads(out.stdout)["summary"]["step"] == 400


@pytest.mark.slow
def test_follow_flags_the_spike_and_blowup_while_wandb_is_still_writing_the_run(tmp_path):
    """wandb writes 100 steps and waits; once the follower has read the run as running, wandb writes
    the rest (the spike at 120, the blow-up from 160) and finishes: the follower flags both, then stops."""
    go = tmp_path / "go"
    (tmp_path / "w").mkdir()
    writer = subprocess.Popen([sys.executable, "-m", "tests.analysis.wandb_writer", str(tmp_path / "w"), "--steps",
                               "200", "--spike", "120", "--blowup", "160", "--pause-at", "100", "--go-file", str(go)],
                              stdout=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    follower = None
    try:
        run = Path(writer.stdout.readline().strip())
        follower = subprocess.Popen([sys.executable, "-m", "ladder.cli", "compare", f"wandb:{run}", "--metric-names",
                                     "olmo-core", "--follow", "--interval", "0.5", "--max-wait", "600"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
        lines = []
        for line in follower.stdout:
            lines.append(line.rstrip())
            if "(running)" in line:
                go.touch()  # the follower has read the half-written run: let wandb write the rest
        follower.wait(timeout=600)
    finally:
        go.touch()
        writer.wait(timeout=300)
        if follower is not None and follower.poll() is None:
            follower.kill()
    running = [int(ln.split()[1]) for ln in lines if ln.startswith("step ") and "(running)" in ln]
    assert running and min(running) <= 100, lines  # it read the run before wandb finished it
    assert any("loss_spike @ step 120" in ln for ln in lines), lines
    assert any("grad_norm_high @ step" in ln for ln in lines) and any("(finished)" in ln for ln in lines), lines
    assert follower.returncode == 3
