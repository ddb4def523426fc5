"""The ladder's two rules, each in one place:

- size -> model: `moe_model(d_model, n_layers)` gives Marin's MoE shape at any width
  (head dim 128, KV heads = heads / 4, routed experts of width d/2 inside a latent of d/2,
  shared experts at full width with hidden d/2);
- (model, batch, steps) -> run: `run_spec(...)` gives the data, optimiser and schedule of a rung
  (1% warmup, linear decay to 5% of peak, z-loss 1e-4);
- compute -> batch: `scaled_batch(...)` shrinks the batch of a smaller run from the hero's, by a
  power of the compute ratio, so that small rungs still take enough optimiser steps.
Experiment files call these with their few numbers, so every rung and the hero share one shape rule.
"""

from __future__ import annotations

import math
from typing import Any

from core.spec import ModelSpec, Spec


def moe_model(
    d_model: int,
    n_layers: int,
    *,
    head_dim: int = 128,
    kv_ratio: int = 4,
    vocab_size: int = 128_256,
    n_routed_experts: int = 384,
    top_k: int = 8,
    n_shared_experts: int = 2,
    latent_ratio: float = 0.5,
    expert_ratio: float = 0.5,
    capacity_factor: float = 1.15,
    n_waves: int = 3,
    ep_size: int = 64,
    window: int | None = 2048,
    dispatch: str = "capacity",
    **overrides: Any,
) -> ModelSpec:
    n_heads = d_model // head_dim
    latent = int(d_model * latent_ratio) if latent_ratio < 1 else None
    fields = dict(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=max(1, n_heads // kv_ratio),
        head_dim=head_dim,
        vocab_size=vocab_size,
        n_routed_experts=n_routed_experts,
        top_k=top_k,
        n_shared_experts=n_shared_experts,
        expert_hidden=int(d_model * expert_ratio),
        shared_hidden=int(d_model * expert_ratio),
        latent_dim=latent,
        capacity_factor_send=capacity_factor,
        capacity_factor_recv=capacity_factor,
        n_waves=n_waves,
        ep_size=ep_size,
        attention_window=window,
        dispatch=dispatch,
    )
    fields.update(overrides)
    return ModelSpec(**fields)


def run_spec(
    name: str,
    model: ModelSpec,
    *,
    batch_size: int,
    steps: int,
    seq_len: int,
    sources: list[dict],
    peak_lr: float,
    role: str = "rung",
    engine: str = "torch",
    seed: int = 0,
    hardware: dict | None = None,
    data: dict | None = None,
    optim: dict | None = None,
    schedule: dict | None = None,
    run: dict | None = None,
    tokenizer: str = "bytes",
) -> Spec:
    return Spec.model_validate(
        {
            "name": name,
            "role": role,
            "engine": engine,
            "seed": seed,
            "model": model.model_dump(),
            "data": {
                "sources": sources,
                "tokenizer": tokenizer,
                "seq_len": seq_len,
                "batch_size": batch_size,
                "total_tokens": steps * batch_size * seq_len,
                **(data or {}),
            },
            "optim": {"peak_lr": peak_lr, "z_loss": 1e-4, **(optim or {})},
            "schedule": {"warmup_frac": 0.01, "decay": "linear", "min_lr_ratio": 0.05, **(schedule or {})},
            "hardware": hardware or {},
            "run": run or {},
        }
    )


def scaled_batch(flops: float, ref_flops: float, ref_batch: int, *, exponent: float = 0.5, min_batch: int = 8) -> int:
    """The batch (in sequences) of a run with `flops` of training compute, given the reference run's
    (`ref_flops`, `ref_batch`): ref_batch * (flops / ref_flops) ** exponent, rounded to the nearest
    power of two in log scale and kept within [min_batch, ref_batch]. At a fixed number of tokens per
    parameter, compute grows as the square of the size, so the exponent 0.5 keeps the number of
    optimiser steps about the same across sizes; a smaller exponent (DeepSeek LLM fits 0.33 for the
    compute-optimal batch) gives small runs fewer, larger steps."""
    if not (flops > 0 and ref_flops > 0 and ref_batch >= 1):
        raise ValueError(f"scaled_batch needs positive compute and batch (got {flops}, {ref_flops}, {ref_batch})")
    raw = ref_batch * (flops / ref_flops) ** exponent
    batch = 2 ** round(math.log2(raw))
    return int(min(max(batch, min_batch), ref_batch))
