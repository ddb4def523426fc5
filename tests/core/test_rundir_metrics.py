"""metrics.jsonl is the source of truth: a writer opened at a resume step drops only the records at
or past it, and a file with nothing to drop is left byte for byte, damaged lines included."""

from __future__ import annotations

import json

from core.rundir import MetricsWriter, RunDir


def _write(path, steps, damage: bytes = b""):
    lines = [json.dumps({"step": s, "loss": 3.0 - 0.01 * s}).encode() for s in steps]
    if damage:
        lines.insert(2, damage)
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_a_writer_at_the_end_of_a_run_leaves_a_damaged_file_as_it_is(tmp_path):
    path = RunDir(tmp_path).metrics_path
    _write(path, range(6), damage=b'{"step": 2, "loss": 3.')  # a torn line mid-file
    before = path.read_bytes()
    MetricsWriter(tmp_path, 6)
    assert path.read_bytes() == before


def test_a_writer_at_a_resume_step_drops_the_records_from_it_on(tmp_path):
    path = RunDir(tmp_path).metrics_path
    _write(path, range(6))
    MetricsWriter(tmp_path, 4).write({"step": 4, "loss": 1.0})
    assert [r["step"] for r in RunDir(tmp_path).read_metrics()] == [0, 1, 2, 3, 4]


def test_a_torn_last_line_is_cut_before_a_record_is_appended(tmp_path):
    path = RunDir(tmp_path).metrics_path
    _write(path, range(3))
    with open(path, "ab") as f:
        f.write(b'{"step": 3, "lo')  # a write cut short: no newline
    MetricsWriter(tmp_path, 3).write({"step": 3, "loss": 1.0})
    assert path.read_text().splitlines()[-1] == '{"step": 3, "loss": 1.0}'
    assert [r["step"] for r in RunDir(tmp_path).read_metrics(warn=None)] == [0, 1, 2, 3]
