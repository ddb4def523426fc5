"""Every reader of metrics.jsonl skips a damaged line (non-UTF-8 bytes, a torn record mid-file)
and says so once, naming the file and the line: the ledger, the MLflow tail, the analysis frame,
both process launchers (torch EP, Ray Train) and a replan's continuation."""

from __future__ import annotations

import json
import shutil

import pytest

from core.rundir import RunDir
from engines.base import StepMetrics
from engines.registry import get_engine
from tests.support import tiny_spec

BAD = b"\xff\xfe{not json at all\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec = tiny_spec("readers", steps=6, checkpoint_every=3)
    d = tmp_path_factory.mktemp("readers")
    list(get_engine(spec.engine).train(spec, d, resume=True))
    return spec, d


@pytest.fixture
def damaged(trained, tmp_path):
    """A copy of the run whose metrics.jsonl has a bad line 4 (between steps 2 and 3)."""
    spec, src = trained
    d = tmp_path / "run"
    shutil.copytree(src, d)
    m = d / "metrics.jsonl"
    lines = m.read_bytes().split(b"\n")
    m.write_bytes(b"\n".join(lines[:3]) + b"\n" + BAD + b"\n".join(lines[3:]))
    return spec, d, m


def _one_warning(capsys, m) -> None:
    err = [ln for ln in capsys.readouterr().err.splitlines() if "skipped a bad metrics line" in ln]
    assert len(err) == 1 and f"{m}:4:" in err[0], err


def test_the_ledgers_reader_and_the_analysis_frame_skip_it_with_one_warning(damaged, capsys):
    from analysis.runs.metrics import read_metrics_frame
    from core import rundir

    spec, d, m = damaged
    rundir._warned.clear()
    assert [r["step"] for r in RunDir(d).read_metrics()] == list(range(6))
    _one_warning(capsys, m)
    rundir._warned.clear()
    assert read_metrics_frame(m)["step"].tolist() == list(range(6))
    _one_warning(capsys, m)


def test_the_mlflow_tail_skips_it_with_one_warning(damaged, capsys):
    from core import rundir
    from ladder.tracking import MetricsTail

    spec, d, m = damaged
    rundir._warned.clear()
    assert [r["step"] for r in MetricsTail(m).read()] == list(range(6))
    _one_warning(capsys, m)


def test_the_torch_ep_launcher_skips_it_with_one_warning(damaged, capsys):
    from core import rundir
    from engines.torch.parallel.launch import _read_new

    spec, d, m = damaged
    rundir._warned.clear()
    recs, offset = _read_new(m, 0, 0, 0.0)
    assert [r.step for r in recs] == list(range(6)) and offset == m.stat().st_size
    _one_warning(capsys, m)


def test_the_ray_train_launcher_skips_it_with_one_warning(damaged, capsys):
    from core import rundir
    from ladder.train_launch import _read_records

    spec, d, m = damaged
    rundir._warned.clear()
    recs, offset = _read_records(m, 0, 0)
    assert all(isinstance(r, StepMetrics) for r in recs) and [r.step for r in recs] == list(range(6))
    _one_warning(capsys, m)


def test_a_replans_continuation_copies_the_records_before_its_step_and_skips_it(damaged, tmp_path, capsys):
    from core import rundir
    from engines.checkpoint import init_from_checkpoint, list_checkpoints

    spec, d, m = damaged
    rundir._warned.clear()
    ckpt = next(c for c in list_checkpoints(d) if c.name.endswith("3"))
    init_from_checkpoint(tmp_path / "child", ckpt, metrics_from=d)
    copied = [json.loads(x) for x in (tmp_path / "child" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in copied] == [0, 1, 2]
    _one_warning(capsys, m)
