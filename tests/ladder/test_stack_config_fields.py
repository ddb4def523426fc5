"""`ladder spec from-run` on malformed fields: one line naming the field, exit 2, nothing written;
never an internal error, and never a field silently replaced by another."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from ladder.stack_config import StackConfigError, detect_stack, load_stack_config, spec_from_stack
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
OLMO = DATA / "olmo_core_olmoe_config.json"
CONFIGS = [OLMO, DATA / "levanter_moe_config.yaml", DATA / "levanter_mixtral_8x7b.yaml",
           DATA / "torchtitan_qwen3_30b_a3b.toml"]


def _set(cfg: dict, dotted: str, value) -> dict:
    cfg = copy.deepcopy(cfg)
    node = cfg
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return cfg


@pytest.mark.parametrize("field,value", [
    ("train_module.optim.betas", 5),
    ("train_module.optim.betas", [0.9]),
    ("train_module.optim.eps", {}),
    ("train_module.scheduler.warmup", [1, 2]),
    ("trainer.max_duration.value", math.inf),
    ("dataset.sequence_length", 0),  # was replaced by train_module.max_sequence_length without a word
])
def test_a_malformed_olmo_core_field_is_refused_in_one_line_naming_it(tmp_path, field, value):
    config, out = tmp_path / "config.json", tmp_path / "spec.yaml"
    config.write_text(json.dumps(_set(json.loads(OLMO.read_text()), field, value)))
    r = cli_fork.ladder("spec", "from-run", "--config", config, "--name", "x", "--out", out, cwd=tmp_path,
                        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert field in lines[0] and "internal error" not in lines[0], lines[0]
    assert not out.exists()


def _leaves(d: dict, pre: tuple = ()):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _leaves(v, pre + (k,))
        else:
            yield ".".join(pre + (k,))


BAD = [5, [0.9], {}, [1, 2], math.inf, math.nan, 0, -1, "x", True, 1.5]


WSD = {"_CLASS_": "olmo_core.optim.scheduler.WSD", "warmup": 100, "decay_fraction": 0.2, "decay_min_lr": 4e-5}


@pytest.mark.parametrize("path,scheduler", [(p, None) for p in CONFIGS] + [(OLMO, WSD)],
                         ids=[p.name for p in CONFIGS] + ["olmo_core_wsd"])
def test_every_field_of_every_stack_config_set_to_a_bad_value_gives_a_spec_or_a_named_refusal(path, scheduler):
    base = load_stack_config(path)
    if scheduler is not None:
        base = _set(base, "train_module.scheduler", scheduler)
    stack = detect_stack(base, str(path))
    for field in _leaves(base):
        for bad in BAD:
            try:
                spec_from_stack(stack, _set(base, field, bad), "x", {}, str(path), [])
            except StackConfigError:
                pass
            except Exception as e:  # pragma: no cover - the failure this test is for
                pytest.fail(f"{path.name}: {field} = {bad!r}: {type(e).__name__}: {e}")
