"""The export command of sharded checkpoints refuses what it cannot export in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_exporting_a_run_dir_without_sharded_checkpoints_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engines.torch.parallel.checkpoint", str(tmp_path), "--step", "7"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path} has no sharded checkpoint of step 7 (looked in {tmp_path / 'sharded'})"
    assert not (tmp_path / "checkpoints").exists()
