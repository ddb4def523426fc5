"""Run a test script that exercises Triton kernels in its own process: in Triton's interpreter on
CPU tensors (TRITON_INTERPRET must be set before Triton is imported, and the GPU is hidden because
registered ops dispatch on the device the process sees), or on a GPU as compiled kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
INTERPRETER = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
# Where there is a GPU its test runs the same script compiled. The interpreter itself differs
# between Triton releases: the one beside torch 2.11 cannot loop over loaded bounds, and that
# torch's wrap_triton refuses interpreted kernels.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the compiled kernels instead")


def run_script(code: str, *args: str, **env: str) -> None:
    """python -c code *args with the repository importable; the script must print "ok"."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
