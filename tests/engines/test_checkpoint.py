import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from engines.checkpoint import (
    CheckpointError,
    init_from_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {"embed.weight": rng.normal(size=(4, 3)), "blocks.0.moe.router_bias": np.zeros(2)}


def _opt(params, step):
    opt = {f"m/{k}": v * 0.1 for k, v in params.items() if "bias" not in k}
    opt.update({f"v/{k}": v**2 for k, v in params.items() if "bias" not in k})
    opt["step"] = step
    return opt


def test_round_trip_is_float32_and_keeps_the_step(tmp_path):
    p = _params()
    path = save_checkpoint(tmp_path, 7, p, _opt(p, 7), {"tokens": 123, "engine": "torch"})
    assert path.name == "step_00000007"
    params, opt, state = load_checkpoint(path)
    assert params["embed.weight"].dtype == np.float32
    assert np.array_equal(params["embed.weight"], p["embed.weight"].astype(np.float32))
    assert int(opt["step"]) == 7 and set(opt) == {"m/embed.weight", "v/embed.weight", "step"}
    assert state["step"] == 7 and state["tokens"] == 123


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    p = _params()
    for s in (10, 20, 30, 40):
        save_checkpoint(tmp_path, s, p, _opt(p, s), {}, keep=2)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000030", "step_00000040"]
    assert latest_checkpoint(tmp_path).name == "step_00000040"


KILLER = """
import os, signal, sys
import numpy as np
import engines.checkpoint as ck
real = ck.save_file
def dying_save(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    if path.endswith("optim.safetensors"):
        os.kill(os.getpid(), signal.SIGKILL)   # killed between two files of the new checkpoint
ck.save_file = dying_save
p = {"w": np.full((3, 3), 2.0)}
ck.save_checkpoint(sys.argv[1], 20, p, {"m/w": p["w"], "v/w": p["w"], "step": 20}, {})
"""


def test_a_kill_mid_write_leaves_the_previous_checkpoint_usable(tmp_path):
    p = {"w": np.ones((3, 3))}
    save_checkpoint(tmp_path, 10, p, {"m/w": p["w"], "v/w": p["w"], "step": 10}, {"tokens": 1})
    proc = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path)])
    assert proc.returncode == -signal.SIGKILL
    leftovers = [d.name for d in (tmp_path / "checkpoints").iterdir()]
    assert any(n.startswith(".tmp-step_00000020") for n in leftovers)  # the torn write is there...
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000010"  # ...but never taken for a checkpoint
    params, _, state = load_checkpoint(latest)
    assert np.array_equal(params["w"], np.ones((3, 3), np.float32)) and state["tokens"] == 1
    save_checkpoint(tmp_path, 11, p, {"m/w": p["w"], "v/w": p["w"], "step": 11}, {})
    assert not any(d.name.startswith(".tmp-") for d in (tmp_path / "checkpoints").iterdir())


def test_loading_an_incomplete_directory_is_a_clear_error(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_00000001")


def test_init_from_checkpoint_seeds_a_child_run_with_weights_and_metrics(tmp_path):
    parent, child = tmp_path / "parent", tmp_path / "child"
    p = _params()
    src = save_checkpoint(parent, 5, p, _opt(p, 5), {"spec_id": "abc"})
    (parent / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(8)))
    init_from_checkpoint(child, src, metrics_from=parent)
    params, opt, state = load_checkpoint(latest_checkpoint(child))
    assert state["step"] == 5 and state["spec_id"] == "abc" and int(opt["step"]) == 5
    assert np.array_equal(params["embed.weight"], p["embed.weight"].astype(np.float32))
    steps = [json.loads(l)["step"] for l in (child / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
