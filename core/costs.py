"""Costs as pure functions of a spec.

Counting rules (they reproduce Marin's published 535B-A23B figures):
- total params count everything, embeddings and lm head included;
- active params are the non-embedding parameters one token touches (attention, router, latent
  projections, top_k routed experts, shared experts); norms are negligible and left out of both;
- training FLOPs per token = 6 x (active matmul params + lm head) + attention score/value FLOPs
  (QK^T and AV, 2 x 2 x window-limited context x H x Dh per layer forward, x3 for training).
"""

from __future__ import annotations

import math
from typing import Hashable, Iterable

from core.spec import HardwareSpec, ModelSpec, Spec

BYTES_BF16 = 2
# bf16 weights + bf16 grads + fp32 master + fp32 Adam m and v.
BYTES_PER_PARAM_TRAIN = 2 + 2 + 4 + 4 + 4


def param_counts(m: ModelSpec) -> dict[str, int]:
    d, dl = m.d_model, m.expert_dim
    attn = d * m.n_heads * m.head_dim * 2 + d * m.n_kv_heads * m.head_dim * 2
    router = d * m.n_routed_experts
    latent = 2 * d * m.latent_dim if m.latent_dim else 0
    one_expert = 3 * dl * m.expert_hidden
    shared = m.n_shared_experts * 3 * d * m.shared_hidden
    L = m.n_layers
    parts = {
        "embedding": m.vocab_size * d,
        "lm_head": m.vocab_size * d,
        "attention": L * attn,
        "router": L * router,
        "latent": L * latent,
        "routed_experts": L * m.n_routed_experts * one_expert,
        "shared_experts": L * shared,
    }
    non_embed = parts["attention"] + parts["router"] + parts["latent"] + parts["shared_experts"]
    parts["total"] = sum(parts.values())
    parts["active"] = non_embed + L * m.top_k * one_expert
    parts["dense"] = non_embed  # everything outside the routed experts and embeddings
    return parts


def mean_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a query attends to under a causal (optionally sliding) mask."""
    w = min(window or seq_len, seq_len)
    # positions 0..w-1 see i+1 keys; the rest see w keys
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def flops_per_token(spec: Spec, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward)."""
    m = spec.model
    pc = param_counts(m)
    ctx = mean_context(seq_len or spec.data.seq_len, m.attention_window)
    attn = 2 * 2 * m.n_layers * ctx * m.n_heads * m.head_dim
    return 6.0 * (pc["active"] + pc["lm_head"]) + 3.0 * attn


def total_flops(spec: Spec) -> float:
    tokens = spec.total_steps * spec.data.tokens_per_step
    return flops_per_token(spec) * tokens


def tokens(spec: Spec) -> int:
    return spec.total_steps * spec.data.tokens_per_step


def tokens_per_active_param(spec: Spec) -> float:
    return tokens(spec) / param_counts(spec.model)["active"]


# budgets (tokens per active parameter) closer than this are one budget: steps are rounded per size
BUDGET_RTOL = 0.05


def same_budget(a: float, b: float) -> bool:
    return abs(a / b - 1) <= BUDGET_RTOL


def budgets_by_size(sized: Iterable[tuple[Hashable, float]]) -> dict[Hashable, list[float]]:
    """Each size's distinct budgets from (size, tokens per active parameter) pairs, in order of first
    appearance; a budget within BUDGET_RTOL of one already seen for that size is the same budget."""
    out: dict[Hashable, list[float]] = {}
    for size, tpp in sized:
        seen = out.setdefault(size, [])
        if not any(same_budget(tpp, b) for b in seen):
            seen.append(tpp)
    return out


def a2a_bytes_per_token(m: ModelSpec, latent: bool = True, bytes_per_value: int = BYTES_BF16) -> float:
    """All-to-all bytes one token moves per training step across all layers: dispatch and combine
    forward, and their gradients backward (4 transfers of top_k rows), counting only rows that leave
    their shard ((ep-1)/ep of them under uniform routing). Without the latent, rows are d_model wide."""
    width = m.expert_dim if latent else m.d_model
    remote = (m.ep_size - 1) / m.ep_size if m.ep_size > 1 else 0.0
    return 4.0 * m.n_layers * m.top_k * width * bytes_per_value * remote


def a2a_bytes_per_token_domain(m: ModelSpec, ep_domain: int, latent: bool = True) -> float:
    """As a2a_bytes_per_token, for an EP domain of `ep_domain` GPUs (the hardware layout)."""
    return a2a_bytes_per_token(m.model_copy(update={"ep_size": ep_domain}), latent=latent)


def memory_per_gpu(
    spec: Spec,
    hardware: HardwareSpec | None = None,
    micro_batch_seqs: int = 1,
    activation_checkpointing: bool = True,
    mesh: tuple[int, int] | None = None,
) -> dict[str, float]:
    """Bytes per GPU: routed experts sharded over the EP domain, everything else (dense layers,
    embeddings) sharded over all GPUs ZeRO-3 style; activations for `micro_batch_seqs` sequences.
    With mesh=(dp, ep) (default: hardware.workers / model.ep_size by model.ep_size for a spec of
    several workers), the (data x expert) layout of engines/torch/parallel: the dense parameters over
    all dp * ep devices and each expert shard also over its dp replicas (FSDP2), so every
    parameter, gradient and moment is split dp * ep ways.
    Activations per token per layer: the layer input kept for recomputation (2 bytes x d) with
    checkpointing, else ~34 x d bytes (Korthikanti et al.) plus the routed rows at capacity.
    Also returned: "params_held" (parameters one device holds between steps) and
    "optimizer_fp32" (the bytes of its fp32 AdamW moments)."""
    hw = hardware or spec.hardware
    m = spec.model
    pc = param_counts(m)
    if mesh is None and hw.workers > 1 and hw.workers % m.ep_size == 0:  # a mesh run of several workers
        mesh = (hw.workers // m.ep_size, m.ep_size)
    if mesh is not None:
        dp, ep = mesh
        experts = pc["routed_experts"] / (dp * ep)
        rest = (pc["total"] - pc["routed_experts"]) / (dp * ep)
    else:
        gpus = max(hw.n_gpus, 1)
        ep = min(hw.ep_domain, gpus)
        experts = pc["routed_experts"] / ep
        rest = (pc["total"] - pc["routed_experts"]) / gpus
    states = (experts + rest) * BYTES_PER_PARAM_TRAIN
    tokens_mb = micro_batch_seqs * spec.data.seq_len
    cap = max(m.capacity_factor_send, m.capacity_factor_recv) if m.dispatch == "capacity" else 1.0
    routed_rows = m.top_k * cap * m.expert_dim * 2 * BYTES_BF16
    per_layer = (2 * m.d_model * BYTES_BF16) if activation_checkpointing else (34 * m.d_model + routed_rows)
    acts = tokens_mb * m.n_layers * per_layer
    # one layer is always live in full during its recomputation, plus the logits
    acts += tokens_mb * (34 * m.d_model + routed_rows) + tokens_mb * m.vocab_size * 4
    return {
        "weights_grads_optimizer": states,
        "params_held": experts + rest,
        "optimizer_fp32": (experts + rest) * 8,
        "activations": acts,
        "total": states + acts,
        "fits": (states + acts) <= hw.hbm_gb * 2**30,
    }


def gpu_hours(spec: Spec, mfu: float | None = None, hardware: HardwareSpec | None = None) -> float:
    hw = hardware or spec.hardware
    return total_flops(spec) / (hw.peak_flops * (mfu or hw.expected_mfu)) / 3600.0


def wall_days(spec: Spec, mfu: float | None = None, hardware: HardwareSpec | None = None) -> float:
    hw = hardware or spec.hardware
    return gpu_hours(spec, mfu, hw) / max(hw.n_gpus, 1) / 24.0


def plan_row(spec: Spec, hero_flops: float | None = None) -> dict:
    """One rung's row of `ladder plan` (the JSON keys are a stable interface)."""
    pc = param_counts(spec.model)
    f = total_flops(spec)
    mem = memory_per_gpu(spec)
    return {
        "name": spec.name,
        "role": spec.role,
        "spec_id": spec.id,
        "engine": spec.engine,
        "layers": spec.model.n_layers,
        "d_model": spec.model.d_model,
        "heads": spec.model.n_heads,
        "kv_heads": spec.model.n_kv_heads,
        "experts": f"{spec.model.n_routed_experts} top-{spec.model.top_k} + {spec.model.n_shared_experts} shared",
        "total_params": pc["total"],
        "active_params": pc["active"],
        "params": pc,
        "batch_seqs": spec.data.batch_size,
        "seq_len": spec.data.seq_len,
        "steps": spec.total_steps,
        "tokens": tokens(spec),
        "tokens_per_active_param": tokens_per_active_param(spec),
        "flops_per_token": flops_per_token(spec),
        "flops": f,
        "share_of_hero": (f / hero_flops) if hero_flops else None,
        "memory_per_gpu_gb": mem["total"] / 2**30,
        "memory_fits": bool(mem["fits"]),
        "a2a_bytes_per_token": a2a_bytes_per_token_domain(spec.model, spec.hardware.ep_domain, latent=True),
        "a2a_bytes_per_token_no_latent": a2a_bytes_per_token_domain(spec.model, spec.hardware.ep_domain, latent=False),
        "system": spec.hardware.system,
        "gpus": spec.hardware.n_gpus,
        "mfu": spec.hardware.expected_mfu,
        "gpu_hours": gpu_hours(spec),
        "days": wall_days(spec),
    }


def plan(specs: list[Spec], hero: Spec | None) -> list[dict]:
    hero_flops = total_flops(hero) if hero else None
    rows = [plan_row(s, hero_flops) for s in specs]
    return rows


def ladder_share(rungs: list[Spec], hero: Spec) -> float:
    return sum(total_flops(s) for s in rungs) / total_flops(hero)


def fmt_count(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def fmt_sci(x: float) -> str:
    return f"{x:.2e}" if x and math.isfinite(x) else "-"
