"""An experiment file that raises BaseException or GeneratorExit while loading is one line naming
the file and its line (exit 2), as any other exception is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("exc", ["BaseException('base')", "GeneratorExit('closing')"])
def test_an_experiment_file_raising_a_base_exception_is_one_line_naming_its_line(tmp_path, exc):
    exp = tmp_path / "odd.py"
    exp.write_text(f"import os\n\nraise {exc}\n")
    res = cli_fork.ladder("plan", exp, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[0].startswith(f"error: {exp}: raised {exc.split('(')[0]}") and "(line 3)" in lines[0], lines[0]
