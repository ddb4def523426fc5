"""`ladder spec from-run`: a spec for a run OLMo-core trains, from its experiment config.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.schedule import lr_at
from core.spec import load_spec
from ladder.stack_config import StackConfigError, spec_from_olmo_core

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).parent / "data" / "olmo_core_olmoe_config.json"


def olmoe() -> dict:
    return json.loads(CONFIG.read_text())


def test_an_olmoe_config_gives_its_shape_batch_duration_and_optimizer():
    spec = spec_from_olmo_core(olmoe(), "olmoe")
    m, d, o, s = spec.model, spec.data, spec.optim, spec.schedule
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim) == (16, 2048, 16, 16, 128)
    assert (m.n_routed_experts, m.top_k, m.expert_hidden, m.dispatch) == (64, 8, 1024, "dropless")
    assert (d.seq_len, d.batch_size, d.total_tokens) == (4096, 1024, 5_000_000_000_000)
    assert (o.peak_lr, o.beta2, o.weight_decay, o.z_loss, o.aux_loss, o.router_z_loss) == (4e-4, 0.95, 0.1, 1e-5, 0.01, 0.001)
    assert (s.decay, s.warmup_steps, s.min_lr_ratio) == ("cosine", 2000, 0.1)
    assert spec.seed == 12536


def test_the_spec_schedule_follows_olmo_cores_cosine_with_warmup():
    spec = spec_from_olmo_core(olmoe(), "olmoe")
    assert lr_at(spec, 1000) == pytest.approx(2e-4, rel=1e-3)  # halfway up the 2,000-step warmup
    assert lr_at(spec, spec.total_steps - 1) == pytest.approx(4e-5, rel=1e-3)  # alpha_f x peak at the end


def test_a_wsd_scheduler_decays_over_its_last_fraction():
    cfg = olmoe()
    cfg["train_module"]["scheduler"] = {"_CLASS_": "olmo_core.optim.scheduler.WSD", "warmup": 100, "decay_fraction": 0.2,
                                        "decay_min_lr": 4e-5}
    s = spec_from_olmo_core(cfg, "wsd").schedule
    assert (s.decay, s.decay_start_frac, s.min_lr_ratio) == ("wsd", 0.8, pytest.approx(0.1))


def test_a_duration_in_steps_is_steps_times_the_global_batch():
    cfg = olmoe()
    cfg["trainer"]["max_duration"] = {"value": 1000, "unit": "steps"}
    assert spec_from_olmo_core(cfg, "steps").data.total_tokens == 1000 * 4194304


def test_a_config_without_a_model_section_is_refused_naming_it():
    cfg = olmoe()
    del cfg["model"]
    with pytest.raises(StackConfigError, match="no model section"):
        spec_from_olmo_core(cfg, "x")


def test_the_cli_writes_a_loadable_spec_with_overrides_and_refuses_a_bad_field_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "ladder.cli", "spec", "from-run", "--config", str(CONFIG),
                                     "--name", "olmoe", *a], capture_output=True, text=True, env=env, timeout=120)
    ok = run("--out", str(tmp_path / "s.yaml"), "--set", "hardware.n_gpus=32", "--set", "data.total_tokens=1e12")
    assert ok.returncode == 0, ok.stderr
    spec = load_spec(tmp_path / "s.yaml")
    assert (spec.hardware.n_gpus, spec.data.total_tokens, spec.role) == (32, 10**12, "hero")
    bad = run("--out", str(tmp_path / "t.yaml"), "--set", "optim.peak_lr=-1")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "peak_lr" in lines[0], bad.stderr
    assert not (tmp_path / "t.yaml").exists()


LEVANTER = Path(__file__).parent / "data" / "levanter_moe_config.yaml"


def test_a_levanter_moe_config_gives_the_d768_rungs_shape_and_linear_decay_to_5_percent():
    from ladder.stack_config import load_stack_config, spec_from_levanter

    spec = spec_from_levanter(load_stack_config(LEVANTER), "d768", {"model.vocab_size": 128256}, str(LEVANTER))
    m, d, o, s = spec.model, spec.data, spec.optim, spec.schedule
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.n_routed_experts, m.top_k, m.n_shared_experts) == \
        (8, 768, 6, 1, 64, 8, 2)
    assert (d.seq_len, d.batch_size, spec.total_steps) == (4096, 1024, 11420)
    assert (o.peak_lr, o.beta2, o.z_loss) == (3e-3, 0.98, 1e-4)
    assert (s.decay, s.warmup_frac, s.min_lr_ratio) == ("linear", 0.01, 0.05)


def test_a_levanter_config_without_the_vocabulary_asks_for_it():
    from ladder.stack_config import load_stack_config, spec_from_levanter

    with pytest.raises(StackConfigError, match="model.vocab_size"):
        spec_from_levanter(load_stack_config(LEVANTER), "d768", {}, str(LEVANTER))
