"""The MoE transformer of a spec, in plain JAX: parameters are a flat dict keyed by the
engine-neutral names of engines/base.py (same layouts, x @ w), so a checkpoint is the dict itself.

Shape legend: B batch, S sequence, T tokens (B*S), D model, H query heads, G kv heads, Q head dim,
V vocab, E routed experts, K top-k, L expert width (latent or D), F expert hidden, N shared
experts, R shared hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engines.options import JaxKernels
from engines.params import init_arrays, is_buffer, tensor_shapes
from core.spec import ModelSpec

Params = dict[str, jax.Array]



@dataclass(frozen=True)
class ModelConfig:
    """The static (hashable) part of a spec the forward pass depends on."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    n_experts: int
    top_k: int
    n_shared: int
    expert_hidden: int
    shared_hidden: int
    latent_dim: int | None
    router_kind: str
    bias_balancing: bool
    balance_scope: str
    dispatch: str
    cf_send: float
    cf_recv: float
    n_waves: int
    ep_size: int
    window: int | None
    rope_theta: float
    norm_eps: float
    init_std: float
    compute_dtype: str = "float32"  # matmul inputs; bfloat16 on a GPU (fp32 accumulation, fp32 weights)
    mgpu: str = "1"  # the Mosaic-GPU kernels of dropless dispatch (engines/options.EngineOptions.jax_mgpu)
    mgpu_tiles: str | None = None  # a tile file for them (EngineOptions.jax_mgpu_tiles)
    kernels: JaxKernels = JaxKernels()  # losses, weights, experts, gates (EngineOptions.jax_kernels)

    @classmethod
    def from_spec(cls, m: ModelSpec) -> "ModelConfig":
        return cls(
            n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            head_dim=m.head_dim, vocab_size=m.vocab_size, n_experts=m.n_routed_experts, top_k=m.top_k,
            n_shared=m.n_shared_experts, expert_hidden=m.expert_hidden, shared_hidden=m.shared_hidden,
            latent_dim=m.latent_dim, router_kind=m.router_kind, bias_balancing=m.router_bias_balancing,
            balance_scope=m.balance_scope, dispatch=m.dispatch, cf_send=m.capacity_factor_send,
            cf_recv=m.capacity_factor_recv, n_waves=m.n_waves, ep_size=m.ep_size, window=m.attention_window,
            rope_theta=m.rope_theta, norm_eps=m.norm_eps, init_std=m.init_std,
        )

    @property
    def expert_dim(self) -> int:
        return self.latent_dim or self.d_model

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (trainable parameters and the router-bias buffers), by name."""
    return tensor_shapes(
        n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, n_experts=cfg.n_experts, expert_dim=cfg.expert_dim,
        expert_hidden=cfg.expert_hidden, latent_dim=cfg.latent_dim, n_shared=cfg.n_shared, shared_hidden=cfg.shared_hidden)


def init_params(cfg: ModelConfig, seed: int) -> tuple[Params, Params]:
    """(trainable params, buffers), drawn as in every engine (engines.params.init_arrays)."""
    arrays = init_arrays(param_shapes(cfg), cfg.init_std, cfg.n_layers, seed)
    params = {k: jnp.asarray(v) for k, v in arrays.items() if not is_buffer(k)}
    buffers = {k: jnp.asarray(v) for k, v in arrays.items() if is_buffer(k)}
    return params, buffers


# ---- layers -------------------------------------------------------------------------------


def mm(x: jax.Array, w: jax.Array, dtype, out=jnp.float32) -> jax.Array:
    """x @ w with inputs in the compute dtype and an fp32 result (fp32 master weights stay fp32;
    `out` the compute dtype keeps a 16-bit product as it is).

    In a 16-bit compute dtype the product is formed in that dtype (fp32 accumulation inside the
    kernel, as torch's bf16 matmul) and upcast afterwards: the upcast's transpose hands the
    backward a 16-bit cotangent, so both gradient products run on 16-bit tensor cores. With an
    fp32 result requested instead, the gradients become fp32 x 16-bit products, which XLA runs as
    TF32 GEMMs (about 3x slower; 20 ms of a 140 ms step on an H200)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
    return jnp.matmul(x.astype(dtype), w.astype(dtype)).astype(out)


def einsum(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """jnp.einsum with the dtype rule of mm."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype)).astype(jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [S, Q/2] for rotating (first half, second half) pairs of a head."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def apply_rope(x_BSHQ: jax.Array, cos_SP: jax.Array, sin_SP: jax.Array) -> jax.Array:
    half = x_BSHQ.shape[-1] // 2
    x1, x2 = x_BSHQ[..., :half], x_BSHQ[..., half:]
    cos, sin = cos_SP[None, :, None, :], sin_SP[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(seq_len: int, window: int | None) -> np.ndarray:
    """[S, S] True where query i may attend key j: causal, and within the last `window` positions."""
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


def attend_masked(q_BSHQ, k_BSGQ, v_BSGQ, mask_SS, dtype) -> jax.Array:
    """Attention with an explicit [S, S] mask (fp32 on the CPU: the reference path)."""
    B, S, H, Q = q_BSHQ.shape
    G = k_BSGQ.shape[2]
    # query head h reads kv head h // (H // G) (consecutive query heads share a kv head)
    q_BSGRQ = q_BSHQ.reshape(B, S, G, H // G, Q)
    scores = einsum("bsgrq,btgq->bgrst", q_BSGRQ, k_BSGQ, dtype) / np.sqrt(Q)
    scores = jnp.where(mask_SS, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return einsum("bgrst,btgq->bsgrq", probs, v_BSGQ, dtype).reshape(B, S, H, Q)


def attend_fused(q_BSHQ, k_BSGQ, v_BSGQ, window: int | None, dtype) -> jax.Array:
    """The same attention through jax.nn.dot_product_attention (cuDNN's fused kernel on a GPU):
    causal, the window as (window - 1) keys to the left of each query."""
    S = q_BSHQ.shape[1]
    left = window - 1 if window is not None and window < S else None
    o = jax.nn.dot_product_attention(
        q_BSHQ.astype(dtype), k_BSGQ.astype(dtype), v_BSGQ.astype(dtype), is_causal=True,
        local_window_size=(left, 0) if left is not None else None,
        # left to itself (None) JAX picks its XLA version, which materialises [B, H, S, S] scores
        implementation="cudnn" if jax.default_backend() == "gpu" else None,
    )
    return o.astype(jnp.float32)


def attention(p: Params, b: str, x_BSD: jax.Array, cfg: ModelConfig, cos, sin, mask_SS) -> jax.Array:
    B, S, _ = x_BSD.shape
    H, G, Q, dt = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dtype
    q_BSHQ = apply_rope(mm(x_BSD, p[f"{b}.attn.wq"], dt).reshape(B, S, H, Q), cos, sin)
    k_BSGQ = apply_rope(mm(x_BSD, p[f"{b}.attn.wk"], dt).reshape(B, S, G, Q), cos, sin)
    v_BSGQ = mm(x_BSD, p[f"{b}.attn.wv"], dt).reshape(B, S, G, Q)
    if dt != jnp.float32:
        o_BSHQ = attend_fused(q_BSHQ, k_BSGQ, v_BSGQ, cfg.window, dt)
    else:
        o_BSHQ = attend_masked(q_BSHQ, k_BSGQ, v_BSGQ, mask_SS, dt)
    return mm(o_BSHQ.reshape(B, S, H * Q), p[f"{b}.attn.wo"], dt)


def shared_experts(p: Params, b: str, x_TD: jax.Array, cfg: ModelConfig) -> jax.Array:
    wg, wu, wd = p[f"{b}.moe.shared.w_gate"], p[f"{b}.moe.shared.w_up"], p[f"{b}.moe.shared.w_down"]
    dt = cfg.dtype
    h_NTR = jax.nn.silu(einsum("td,ndr->ntr", x_TD, wg, dt)) * einsum("td,ndr->ntr", x_TD, wu, dt)
    return einsum("ntr,nrd->td", h_NTR, wd, dt)


MoeFn = Callable[[Params, Params, str, jax.Array], tuple[jax.Array, dict]]


def forward(params: Params, buffers: Params, tokens_BS: jax.Array, cfg: ModelConfig, moe_fn: MoeFn):
    """Logits [B, S, V] and per-layer MoE statistics (each a [n_layers, ...] array). The logits
    are fp32, or in the compute dtype where the fused losses read them (JaxKernels.loss "fused")."""
    B, S = tokens_BS.shape
    cos, sin = rope_tables(S, cfg.head_dim, cfg.rope_theta)
    mask_SS = jnp.asarray(attention_mask(S, cfg.window))
    x_BSD = params["embed.weight"][tokens_BS]
    stats = []
    for i in range(cfg.n_layers):
        b = f"blocks.{i}"
        h = rms_norm(x_BSD, params[f"{b}.attn_norm.weight"], cfg.norm_eps)
        x_BSD = x_BSD + attention(params, b, h, cfg, cos, sin, mask_SS)
        h_TD = rms_norm(x_BSD, params[f"{b}.moe_norm.weight"], cfg.norm_eps).reshape(B * S, cfg.d_model)
        y_TD, st = moe_fn(params, buffers, b, h_TD)
        if cfg.n_shared > 0:
            y_TD = y_TD + shared_experts(params, b, h_TD, cfg)
        x_BSD = x_BSD + y_TD.reshape(B, S, cfg.d_model)
        stats.append(st)
    x_BSD = rms_norm(x_BSD, params["final_norm.weight"], cfg.norm_eps)
    logits_BSV = mm(x_BSD, params["lm_head"], cfg.dtype, out=cfg.dtype if cfg.kernels.loss == "fused" else jnp.float32)
    stacked = {k: jnp.stack([s[k] for s in stats]) for k in stats[0]}
    return logits_BSV, stacked
