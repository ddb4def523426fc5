"""A third-party engine is a plugin: a package that declares itself under the
`moe_ladder.engines` entry-point group is found, validated in specs and trains, with no change here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engines.registry import engine_names, get_engine

ROOT = Path(__file__).resolve().parents[2]


def test_builtin_engines_are_registered():
    assert {"torch", "jax"} <= engine_names()


def test_unknown_engine_names_the_registered_ones():
    with pytest.raises(KeyError, match="registered engines: jax, torch"):
        get_engine("nope")


@pytest.fixture
def plugin_path(tmp_path):
    """A site directory holding a plugin package and its dist-info (what pip would install)."""
    site = tmp_path / "site"
    (site / "my_engine").mkdir(parents=True)
    (site / "my_engine" / "__init__.py").write_text(textwrap.dedent(
        """
        from engines.torch.engine import TorchEngine

        class MyEngine(TorchEngine):
            name = "mine"
        """))
    dist = site / "my_engine-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-engine\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[moe_ladder.engines]\nmine = my_engine:MyEngine\n")
    return site


def test_a_plugin_engine_is_found_validated_and_trains(plugin_path, tmp_path):
    from ladder.presets import micro_spec
    from core.spec import save_spec

    spec_file = save_spec(micro_spec(**{"data.total_tokens": 64 * 8 * 5}), tmp_path / "s.yaml")
    env = {**os.environ, "PYTHONPATH": f"{plugin_path}{os.pathsep}{ROOT}"}
    code = "from engines.registry import engine_names; print(sorted(engine_names()))"
    names = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "mine" in names.stdout
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "train", str(spec_file), "--run-dir", str(tmp_path / "run"),
                          "--engine", "mine", "--quiet"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(5))
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "finished"
