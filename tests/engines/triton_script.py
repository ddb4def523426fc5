"""Run a test script that exercises Triton kernels in its own process: in Triton's interpreter on
CPU tensors (TRITON_INTERPRET must be set before Triton is imported, and the GPU is hidden because
registered ops dispatch on the device the process sees), or on a GPU as compiled kernels."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERPRETER = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}


def run_script(code: str, *args: str, **env: str) -> None:
    """python -c code *args with the repository importable; the script must print "ok"."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
