"""Small ready-made specs: the micro spec that trains in seconds on a CPU (tests, examples)."""

from __future__ import annotations

from typing import Any

from core.spec import Spec

MICRO_EVAL_TOKENS = 8 * 8 * 65  # 8 groups of 8 windows of seq_len + 1 = 65 tokens
DEFAULT_SOURCES = (
    {"name": "code", "builtin": "python_code", "weight": 0.7},
    {"name": "docs", "builtin": "python_docs", "weight": 0.3},
)


def micro_spec(name: str = "micro", **changes: Any) -> Spec:
    """A few-thousand-parameter MoE on byte-level real text; `changes` as {"optim.peak_lr": ...}.
    Its fixed eval set is MICRO_EVAL_TOKENS a source (8 eval groups of 8 windows each): at the
    default 2**20 (capped at 1% of the source) the final eval would read about 120k tokens, 2 to 40
    times what a micro run trains on."""
    base = Spec.model_validate(
        {
            "name": name,
            "engine": "torch",
            "seed": 0,
            "model": {
                "n_layers": 2,
                "d_model": 32,
                "n_heads": 4,
                "n_kv_heads": 2,
                "head_dim": 8,
                "vocab_size": 256,
                "n_routed_experts": 8,
                "top_k": 2,
                "n_shared_experts": 1,
                "expert_hidden": 16,
                "shared_hidden": 32,
                "latent_dim": 16,
                "dispatch": "dropless",
                "capacity_factor_send": 1.25,
                "capacity_factor_recv": 1.25,
                "n_waves": 1,
                "ep_size": 2,
                "attention_window": 32,
            },
            "data": {"sources": list(DEFAULT_SOURCES), "seq_len": 64, "batch_size": 8, "total_tokens": 64 * 8 * 100,
                     "eval_tokens": MICRO_EVAL_TOKENS},
            "optim": {"peak_lr": 3e-3, "weight_decay": 0.01},
            "schedule": {"warmup_frac": 0.05, "decay": "linear", "min_lr_ratio": 0.05},
            "run": {"checkpoint_every": 25, "eval_every": 25, "eval_batches": 2},
        }
    )
    return base.replace(**changes) if changes else base
