"""A spec from a Levanter (or Marin, which trains with it) `train_lm` YAML, with Levanter's own defaults
for every field the YAML leaves out.

    spec = spec_from_levanter(yaml.safe_load(open("config/mixtral_8x7b.yaml")), "mixtral", notes=notes)

Levanter reads the YAML with draccus into `TrainLmConfig` (src/levanter/main/train_lm.py:39): `data`,
`model` (an `LmConfig` chosen by `type`), `trainer` (`TrainerConfig`), `optimizer` (`AdamConfig` unless
`type` names another) and `z_loss_weight`. A field the YAML leaves out takes its dataclass default;
the tables below copy those defaults with the file and line they come from (stanford-crfm/levanter at
9263f81e). `notes` collects, as `section.field (value)`, every field set in the YAML, or implied by
the model type, that the spec cannot carry (QK-norm, tied embeddings, another optimizer, ...).
"""

from __future__ import annotations

from typing import Any

from core.spec import Spec
from ladder.stack_common import StackConfigError, get, get_int, validated

__all__ = ["LEVANTER_MODELS", "KNOWN_VOCAB", "spec_from_levanter"]

# Model defaults by `type`. Levanter paths at stanford-crfm/levanter@9263f81e.
_LLAMA = {  # src/levanter/models/llama.py:54-64 (LlamaConfig)
    "seq_len": 2048, "hidden_dim": 4096, "intermediate_dim": 11008, "num_layers": 32, "num_heads": 32,
    "num_kv_heads": 32, "initializer_range": 0.02, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "sliding_window": None, "qk_norm": False, "moe": False,
}
_MISTRAL = {  # src/levanter/models/mistral.py:49-58 (MistralConfig(LlamaConfig))
    **_LLAMA, "seq_len": 8192, "intermediate_dim": 14336, "num_kv_heads": 8, "layer_norm_epsilon": 1e-6,
    "sliding_window": 4096,
}
LEVANTER_MODELS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "mistral": _MISTRAL,
    # src/levanter/models/mixtral.py:64-80 (MixtralConfig(MistralConfig)); sliding_window is
    # MistralConfig's (mistral.py:58), inherited
    "mixtral": {**_MISTRAL, "tie_word_embeddings": False, "num_experts_per_tok": 2, "n_routed_experts": 8,
                "n_shared_experts": 0, "lbl_coef": 0.01, "rzl_coef": 0.001, "moe": True},
    # src/levanter/models/qwen.py:299-306 (Qwen3Config(LlamaConfig)): use_sliding_window False, so full
    # attention; QK-norm always (qwen.py:376 `qk_norm=self.norm_config`)
    "qwen3": {**_LLAMA, "qk_norm": True},
    # src/levanter/models/olmo.py:53-62 (Olmo2Config); QK-norm always (olmo.py:241)
    "olmo2": {**_LLAMA, "seq_len": 4096, "layer_norm_epsilon": 1e-6, "qk_norm": True},
}
# src/levanter/layers/rotary.py:77 DefaultRotaryEmbeddingsConfig.theta = 10000 (every model above)
ROPE_THETA = 10000.0
# src/levanter/optim/config.py:112-130 (OptimizerConfig) and :405-410 (AdamConfig)
OPTIMIZER = {"learning_rate": 6e-4, "weight_decay": 0.1, "min_lr_ratio": 0.1, "warmup": 0.01, "decay": None,
             "lr_schedule": "cosine", "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8, "max_grad_norm": 1.0}
# src/levanter/trainer.py:646 seed, :694 train_batch_size, :709 num_train_steps (TrainerConfig)
TRAINER = {"seed": 0, "train_batch_size": 512, "num_train_steps": 400_000}
# src/levanter/main/train_lm.py:53 z_loss_weight; src/levanter/data/text.py:525 LMTaskConfig.tokenizer
Z_LOSS_WEIGHT, TOKENIZER = 0.0, "gpt2"

# Levanter sizes the vocabulary from the tokenizer (train_lm.py:134 `vocab_size = len(tokenizer)`);
# these are the lengths of a few public tokenizers, so no download is needed. Others: --set model.vocab_size.
KNOWN_VOCAB = {
    "gpt2": 50257,
    "mistralai/Mixtral-8x7B-v0.1": 32000, "mistralai/Mistral-7B-v0.1": 32000,
    "meta-llama/Llama-2-7b-hf": 32000, "NousResearch/Llama-2-7b-hf": 32000,
    "meta-llama/Meta-Llama-3-8B": 128256, "meta-llama/Meta-Llama-3.1-8B": 128256, "meta-llama/Llama-3.1-8B": 128256,
    "stanford-crfm/marin-tokenizer": 128256,  # Marin's: Llama 3's vocabulary
}

# fields that change how a run is computed, not what it trains: not named as dropped
_OPERATIONAL = {
    "type", "gradient_checkpointing", "scan_layers", "use_flash_attention", "attn_backend",
    "flash_attention_block_size", "upcast_attn", "reference_checkpoint", "tokenizer", "cross_entropy_block_size",
}
_MODEL_CARRIED = {"seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "initializer_range", "layer_norm_epsilon", "rope", "sliding_window", "num_experts_per_tok",
                  "n_routed_experts", "n_shared_experts", "lbl_coef", "rzl_coef", "tie_word_embeddings",
                  "activation_function", "use_bias", "use_layer_norm_weight", "hybrid_norm", "input_embedding_norm",
                  "use_sliding_window"}
# model flags this project's model has one way only: named when the YAML sets them otherwise
_MODEL_FIXED = {"tie_word_embeddings": False, "activation_function": "silu", "use_bias": False,
                "use_layer_norm_weight": True, "hybrid_norm": False, "input_embedding_norm": False}
_OPT_CARRIED = {"type", "learning_rate", "weight_decay", "min_lr_ratio", "warmup", "decay", "lr_schedule", "beta1",
                "beta2", "epsilon", "max_grad_norm"}


def _sources(data: dict, origin: str) -> tuple[list[dict], str]:
    """Spec sources (name, weight, paths) from Levanter's data section, and its tokenizer."""
    tok = str(data.get("tokenizer") or TOKENIZER)

    def paths(d: dict, name: str) -> list[str]:
        urls = d.get("train_urls") or []
        if not isinstance(urls, (list, tuple)):
            raise StackConfigError(f"{origin}: data.train_urls is {urls!r}, expected a list of paths or URLs")
        got = [str(u) for u in urls] or \
              [str(d[k]) for k in ("id", "cache_dir") if d.get(k)]
        return got or [f"{origin}#{name}"]

    configs = data.get("configs")
    if isinstance(configs, dict) and configs:
        weights = data.get("train_weights") or {}
        if not isinstance(weights, dict):  # a weight schedule [(step, {name: w}), ...]: its first stage
            weights = dict(weights[0][1]) if weights and isinstance(weights[0], (list, tuple)) else {}
        out = [{"name": str(k), "weight": float(weights.get(k, 0.0 if weights else 1.0)),
                "paths": paths(v if isinstance(v, dict) else {}, str(k))} for k, v in configs.items()]
        return out, tok
    return [{"name": "data", "weight": 1.0, "paths": paths(data, "data")}], tok


def spec_from_levanter(cfg: dict, name: str, overrides: dict[str, Any] | None = None, origin: str = "config",
                       notes: list[str] | None = None) -> Spec:
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise StackConfigError(f"{origin}: no model section (is this a Levanter train_lm config?)")
    notes = notes if notes is not None else []
    overrides = dict(overrides or {})
    m, tr, opt = cfg["model"], cfg.get("trainer") or {}, cfg.get("optimizer") or {}
    data = cfg.get("data") or {}
    kind = str(m.get("type", "llama")).lower()  # TrainLmConfig.model defaults to LlamaConfig (train_lm.py:42)
    if kind not in LEVANTER_MODELS:
        raise StackConfigError(f"{origin}: model type {kind!r} is not one this reader knows "
                               f"({', '.join(sorted(LEVANTER_MODELS))}); write the spec by hand")
    dm = LEVANTER_MODELS[kind]

    def mv(key: str, types: tuple = (int, float)) -> Any:
        return get(m, key, origin + " model", dm.get(key), types=types)

    d_model, n_heads = mv("hidden_dim"), get_int(m, "num_heads", origin + " model", dm.get("num_heads"), minimum=1)
    moe = dm["moe"]
    sources, tok = _sources(data, origin)
    if "model.vocab_size" not in overrides:
        if tok not in KNOWN_VOCAB:
            raise StackConfigError(f"{origin}: Levanter takes the vocabulary from its tokenizer ({tok}); "
                                   "give --set model.vocab_size=N")
        overrides["model.vocab_size"] = KNOWN_VOCAB[tok]
    steps = get(tr, "num_train_steps", origin + " trainer", TRAINER["num_train_steps"])
    batch = tr.get("train_batch_size", TRAINER["train_batch_size"])
    if not isinstance(batch, int) or isinstance(batch, bool):
        raise StackConfigError(f"{origin}: trainer.train_batch_size {batch!r} is a schedule; give --set data.batch_size=N "
                               "(the spec's batch is one size)")
    seq = mv("seq_len")

    def ov(key: str, types: tuple = (int, float)) -> Any:
        return get(opt, key, origin + " optimizer", OPTIMIZER[key], types=types)

    warm, decay = ov("warmup"), ov("decay")
    shape = str(ov("lr_schedule", types=(str,))).lower()
    sched: dict[str, Any] = {"min_lr_ratio": float(ov("min_lr_ratio"))}
    # src/levanter/optim/config.py:263 warmup via _convert_frac_or_steps: <= 1 a fraction, else steps
    sched.update({"warmup_frac": float(warm)} if 0 < warm < 1 else {"warmup_steps": int(warm)})
    if shape == "constant":
        sched.update({"decay": "constant", "min_lr_ratio": 1.0})
    elif decay is None and shape in ("cosine", "linear"):
        sched["decay"] = shape  # config.py:272-275: decay over every step after warmup
    elif decay is not None and shape == "linear":
        frac = float(decay) if decay < 1 else float(decay) / steps
        sched.update({"decay": "wsd", "decay_start_frac": 1.0 - frac})
    else:
        raise StackConfigError(f"{origin}: optimizer lr_schedule {shape!r}" + (f" with decay {decay}" if decay is not None else "")
                               + " is not one this project models; give --set schedule.*")
    opt_type = str(opt.get("type", "adam")).lower()
    if opt_type not in ("adam", "adamw"):
        notes.append(f"optimizer.type ({opt_type}: modelled as AdamW)")
    for k, v in opt.items():
        if k not in _OPT_CARRIED and v not in (None, False, 0, 0.0):
            notes.append(f"optimizer.{k} ({v})")
    for k, v in m.items():
        if k in _OPERATIONAL:
            continue
        if k not in _MODEL_CARRIED:
            notes.append(f"model.{k} ({v})")
        elif k in _MODEL_FIXED and str(v).lower() != str(_MODEL_FIXED[k]).lower():
            notes.append(f"model.{k} ({v})")
    rope = m.get("rope")
    if isinstance(rope, dict) and str(rope.get("type", "default")).lower() != "default":
        notes.append(f"model.rope.type ({rope.get('type')}: only theta carried)")
    if dm["qk_norm"]:
        notes.append(f"model.qk_norm (Levanter's {kind} always normalises queries and keys)")
    window = mv("sliding_window") if dm.get("sliding_window") is not None or "sliding_window" in m else None
    if kind == "qwen3" and not m.get("use_sliding_window"):
        window = None
    spec_dict: dict[str, Any] = {
        "name": name,
        "seed": int(get(tr, "seed", origin, TRAINER["seed"])),
        "model": {
            "n_layers": mv("num_layers"), "d_model": d_model, "n_heads": n_heads,
            "n_kv_heads": mv("num_kv_heads"), "head_dim": get(m, "head_dim", origin, d_model // n_heads),
            "vocab_size": 256, "init_std": mv("initializer_range"),
            "norm_eps": mv("layer_norm_epsilon"), "rope_theta": get(m, "rope.theta", origin, ROPE_THETA),
            "n_routed_experts": mv("n_routed_experts") if moe else 1,
            "top_k": mv("num_experts_per_tok") if moe else 1,
            "expert_hidden": mv("intermediate_dim"),
            "n_shared_experts": mv("n_shared_experts") if moe else 0,
            "attention_window": int(window) if window and window < seq else None,
        },
        "data": {
            "sources": sources, "tokenizer": tok.rsplit("/", 1)[-1],
            "seq_len": int(seq), "batch_size": int(batch), "total_tokens": int(steps) * int(batch) * int(seq),
        },
        "optim": {
            "peak_lr": float(ov("learning_rate")), "beta1": float(ov("beta1")), "beta2": float(ov("beta2")),
            "eps": float(ov("epsilon")), "weight_decay": float(ov("weight_decay")),
            "grad_clip": float(ov("max_grad_norm") or 1e9),  # None: no clipping
            "z_loss": float(get(cfg, "z_loss_weight", origin, Z_LOSS_WEIGHT)),
            "aux_loss": float(mv("lbl_coef") or 0.0) if moe else 0.0,
            "router_z_loss": float(mv("rzl_coef") or 0.0) if moe else 0.0,
        },
        "schedule": sched,
    }
    if spec_dict["model"]["n_shared_experts"]:
        spec_dict["model"]["shared_hidden"] = spec_dict["model"]["expert_hidden"]
    return validated(spec_dict, overrides, origin)
