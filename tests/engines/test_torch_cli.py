"""`ladder train` as a user runs it: bad input is one clear line and exit 2, no traceback."""

from ladder.presets import micro_spec
from core.spec import save_spec
from tests import cli_fork


def test_a_missing_data_source_is_named_and_nothing_is_trained(tmp_path):
    spec = micro_spec(**{"data.sources": [{"name": "mybooks", "weight": 1.0, "paths": [str(tmp_path / "books/*.txt")]}]})
    path = save_spec(spec, tmp_path / "spec.yaml")
    out = cli_fork.ladder("train", path, "--run-dir", tmp_path / "run", timeout=600)
    assert out.returncode == 2
    assert "mybooks" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
