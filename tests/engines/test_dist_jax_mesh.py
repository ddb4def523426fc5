"""The JAX engine on a (data, expert) mesh of 4 emulated CPU devices (2 x 2, XLA's forced host
device count in a subprocess) gives the one-device engine's losses, gradient norms, drops and
final weights, with the parameters and moments FSDP-sharded along data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engines.base import read_metrics
from engines.checkpoint import latest_checkpoint, load_checkpoint
from tests.support import xla_flags

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from engines.trainer import Trainer
    from tests.engines.test_parallel_mesh import SPEC

    spec = SPEC.replace(engine="jax")
    mode, run = sys.argv[1], sys.argv[2]
    if mode == "mesh":
        from engines.jax.mesh import mesh_step_module

        module = mesh_step_module(spec, 2)
        list(Trainer(spec, run, module).fit())
        st = module.state
        shardings = {"wq": list(st.params["blocks.0.attn.wq"].sharding.spec),
                     "w_up": list(st.params["blocks.0.moe.experts.w_up"].sharding.spec),
                     "moments": [list(x.sharding.spec) for x in jax.tree_util.tree_leaves(st.opt_state)
                                 if x.ndim >= 2]}
    else:
        from engines.jax.engine import JaxEngine

        list(JaxEngine().train(spec, run))
        shardings = {}
    print("RESULT " + json.dumps({"devices": len(jax.devices()), **shardings}))
    """
)


def _run(mode: str, run_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    if mode == "mesh":
        env["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(run_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jaxmesh")
    return root, _run("one", root / "one"), _run("mesh", root / "mesh")


def test_the_2x2_mesh_gives_the_one_device_losses_grad_norms_and_drops(runs):
    root, one, mesh = runs
    assert (one["devices"], mesh["devices"]) == (1, 4)
    a, b = read_metrics(root / "one"), read_metrics(root / "mesh")
    assert [r["step"] for r in b] == list(range(6))
    for key in ("loss", "grad_norm", "aux_loss", "z_loss"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=2e-5, err_msg=key)
    for key in ("drop_frac_send", "drop_frac_recv"):
        assert [r[key] for r in b] == [r[key] for r in a], key
        assert all(r[key] > 0 for r in a), key


def test_the_2x2_mesh_ends_in_the_one_device_weights(runs):
    root, _, _ = runs
    ref, _, _ = load_checkpoint(latest_checkpoint(root / "one"))
    got, _, _ = load_checkpoint(latest_checkpoint(root / "mesh"))
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=5e-5, err_msg=k)


def test_parameters_and_moments_stay_sharded_along_data_after_training(runs):
    _, _, mesh = runs
    assert mesh["wq"] == ["data"]
    assert mesh["w_up"] == ["ep", "data"]
    assert mesh["moments"] and all("data" in s for s in mesh["moments"]), mesh["moments"]
