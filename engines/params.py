"""The engine-neutral parameter set: names, shapes and initial values, shared by every engine so
that one engine's checkpoint is the other's (names and layouts are listed in engines/base.py).

Shape legend: V vocab, D d_model, E routed experts, L expert width (the latent when there is one),
F expert hidden, N shared experts, R shared hidden.
"""

from __future__ import annotations

import math

import numpy as np

BUFFER_SUFFIX = ".moe.router_bias"  # balancing bias: a buffer, never trained or decayed


def tensor_shapes(
    *, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, vocab_size: int,
    n_experts: int, expert_dim: int, expert_hidden: int, latent_dim: int | None, n_shared: int, shared_hidden: int,
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (parameters and router-bias buffers) by name, in the fixed order
    the initial values are drawn in."""
    D, V, E, F, L = d_model, vocab_size, n_experts, expert_hidden, expert_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, D)}
    for i in range(n_layers):
        b = f"blocks.{i}"
        shapes[f"{b}.attn_norm.weight"] = (D,)
        shapes[f"{b}.attn.wq"] = (D, n_heads * head_dim)
        shapes[f"{b}.attn.wk"] = (D, n_kv_heads * head_dim)
        shapes[f"{b}.attn.wv"] = (D, n_kv_heads * head_dim)
        shapes[f"{b}.attn.wo"] = (n_heads * head_dim, D)
        shapes[f"{b}.moe_norm.weight"] = (D,)
        shapes[f"{b}.moe.router"] = (D, E)
        shapes[f"{b}.moe.router_bias"] = (E,)
        if latent_dim is not None:
            shapes[f"{b}.moe.latent_down"] = (D, L)
            shapes[f"{b}.moe.latent_up"] = (L, D)
        shapes[f"{b}.moe.experts.w_gate"] = (E, L, F)
        shapes[f"{b}.moe.experts.w_up"] = (E, L, F)
        shapes[f"{b}.moe.experts.w_down"] = (E, F, L)
        if n_shared > 0:
            N, R = n_shared, shared_hidden
            shapes[f"{b}.moe.shared.w_gate"] = (N, D, R)
            shapes[f"{b}.moe.shared.w_up"] = (N, D, R)
            shapes[f"{b}.moe.shared.w_down"] = (N, R, D)
    shapes["final_norm.weight"] = (D,)
    shapes["lm_head"] = (D, V)
    return shapes


def is_buffer(name: str) -> bool:
    return name.endswith(BUFFER_SUFFIX)


def init_arrays(shapes: dict[str, tuple[int, ...]], init_std: float, n_layers: int, seed: int) -> dict[str, np.ndarray]:
    """Deterministic initial values (float32 numpy), the same in every engine: one
    np.random.default_rng(seed) drawn in `shapes` order; norm weights 1, router biases 0 (no draw for
    either), matrices N(0, init_std), output projections (attn.wo, w_down) scaled by 1/sqrt(2 n_layers)."""
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / math.sqrt(2.0 * n_layers)
    out = {}
    for name, shape in shapes.items():
        if is_buffer(name):
            out[name] = np.zeros(shape, np.float32)
        elif name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            std = init_std * (out_scale if name.endswith(("attn.wo", "w_down")) else 1.0)
            out[name] = rng.normal(0.0, std, size=shape).astype(np.float32)
    return out
