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
                                     "--name", "olmoe", *a], capture_output=True, text=True, env=env, timeout=600)
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


def test_a_levanter_config_whose_tokenizer_is_not_known_asks_for_the_vocabulary():
    from ladder.stack_config import load_stack_config, spec_from_levanter

    cfg = load_stack_config(LEVANTER)
    cfg["data"]["tokenizer"] = "someone/private-tokenizer"
    with pytest.raises(StackConfigError, match="model.vocab_size"):
        spec_from_levanter(cfg, "d768", {}, str(LEVANTER))


MIXTRAL = Path(__file__).parent / "data" / "levanter_mixtral_8x7b.yaml"
QWEN3_TOML = Path(__file__).parent / "data" / "torchtitan_qwen3_30b_a3b.toml"


def test_levanters_mixtral_yaml_takes_levanters_defaults_for_what_it_leaves_out():
    from ladder.stack_config import load_stack_config, spec_from_levanter

    spec = spec_from_levanter(load_stack_config(MIXTRAL), "mixtral", {}, str(MIXTRAL))
    m, d, o = spec.model, spec.data, spec.optim
    # MixtralConfig / MistralConfig defaults (src/levanter/models/mixtral.py:64-80, mistral.py:58)
    assert (m.n_kv_heads, d.seq_len, m.norm_eps, m.attention_window) == (8, 8192, 1e-6, 4096)
    assert (m.n_routed_experts, m.top_k, m.expert_hidden, m.vocab_size) == (8, 2, 14336, 32000)
    assert (o.grad_clip, o.peak_lr, o.aux_loss, o.router_z_loss) == (1.0, 1.2e-5, 0.01, 0.001)  # AdamConfig
    assert d.tokenizer == "Mixtral-8x7B-v0.1" and d.sources[0].paths[0].startswith("gs://pubmed-mosaic/openwebtext")


def test_levanters_mixtral_counts_mixtrals_published_46_7b_total_and_12_9b_active_parameters():
    from core.costs import param_counts
    from ladder.stack_config import load_stack_config, spec_from_levanter

    pc = param_counts(spec_from_levanter(load_stack_config(MIXTRAL), "mixtral", {}, str(MIXTRAL)).model)
    assert pc["total"] == pytest.approx(46.7e9, rel=0.01)
    # Mistral's 12.9B active counts the embedding and output layer; this project's active count does not
    assert pc["active"] + pc["embedding"] + pc["lm_head"] == pytest.approx(12.9e9, rel=0.01)


def torchtitan_qwen3_moe_params(dim, n_layers, n_heads, n_kv, head_dim, vocab, n_exp, top_k, inter) -> tuple[int, int]:
    """torchtitan's own count: the parameters of torchtitan/models/qwen3/model/model.py's modules
    (tok_embeddings, per layer wq/wk/wv/wo, q_norm/k_norm, attention_norm/ffn_norm, moe.router.gate,
    moe.experts w1/w2/w3; final norm; output), split as get_moe_model_nparams_and_flops does
    (torchtitan/models/utils.py:434-481: active = dense + router + experts x top_k / num_experts)."""
    attn = dim * n_heads * head_dim * 2 + dim * n_kv * head_dim * 2 + 2 * head_dim
    dense = vocab * dim * 2 + dim + n_layers * (attn + 2 * dim)
    router, experts = n_layers * dim * n_exp, n_layers * n_exp * 3 * dim * inter
    return dense + router + experts, dense + router + experts * top_k // n_exp


def test_a_torchtitan_qwen3_moe_toml_gives_torchtitans_own_parameter_count():
    from core.costs import param_counts
    from ladder.stack_config import load_stack_config, spec_from_stack

    spec = spec_from_stack("torchtitan", load_stack_config(QWEN3_TOML), "q3", {"data.batch_size": 64}, str(QWEN3_TOML))
    m = spec.model
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.n_routed_experts, m.top_k, m.expert_hidden) == \
        (48, 2048, 32, 4, 128, 128, 8, 768)
    assert (spec.data.seq_len, spec.total_steps, spec.optim.peak_lr, spec.optim.grad_clip) == (4096, 10, 3e-4, 1.0)
    assert (spec.schedule.warmup_steps, spec.schedule.decay, spec.schedule.min_lr_ratio) == (2, "linear", 0.0)
    total, active = torchtitan_qwen3_moe_params(2048, 48, 32, 4, 128, 151936, 128, 8, 768)
    pc = param_counts(m)
    assert pc["total"] == pytest.approx(total, rel=0.01)
    assert pc["active"] + pc["embedding"] + pc["lm_head"] == pytest.approx(active, rel=0.01)


@pytest.mark.parametrize("path,stack", [(CONFIG, "olmo-core"), (LEVANTER, "levanter"), (MIXTRAL, "levanter"),
                                        (QWEN3_TOML, "torchtitan")])
def test_the_stack_is_detected_from_the_config_file(path, stack):
    from ladder.stack_config import detect_stack, load_stack_config

    assert detect_stack(load_stack_config(path)) == stack


def test_qk_norm_is_named_in_one_warning_line_not_dropped_silently(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "spec", "from-run", "--config", str(CONFIG), "--name", "olmoe",
                          "--out", str(tmp_path / "s.yaml")], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    warn = [ln for ln in out.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "qk_norm" in warn[0], out.stderr
    assert "7.12B parameters" in out.stdout  # OLMo-core's own count for this config


def test_a_wandb_runs_config_gives_the_same_spec_as_its_config_json(tmp_path):
    pytest.importorskip("wandb")
    from ladder.stack_config import detect_stack, load_stack_config, spec_from_stack

    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, "-m", "tests.analysis.wandb_writer", str(tmp_path), "--steps", "3",
                          "--config-json", str(CONFIG)], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    cfg = load_stack_config(f"wandb:{out.stdout.strip().splitlines()[-1]}")
    assert detect_stack(cfg) == "olmo-core"
    assert spec_from_stack("olmo-core", cfg, "o", {}) == spec_from_stack("olmo-core", olmoe(), "o", {})
