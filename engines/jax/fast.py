"""Grouped matmul for dropless dispatch on Hopper GPUs: JAX's Pallas Mosaic-GPU ragged dot kernels
(jax.experimental.pallas.ops.gpu) behind a custom VJP, as an alternative to lax.ragged_dot.

    y_AN = mgpu_gmm(x_AK, w_EKN, sizes_E)   # rows of x sorted by group, sizes_E rows per group

Backward: dx = ragged dot of dy with each group's w transposed (the same kernel, transpose_rhs),
dw = the transposed ragged dot (x_e^T dy_e per group). Inputs in bf16 (the kernels need equal
16-bit dtypes); the tile sizes are MGPU_TUNED's for the matmuls tuned on an H200, else MGPU.
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache, partial
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from pydantic import BaseModel, ConfigDict, PositiveInt, ValidationError, field_validator

from core.options import OptionsError

MGPU = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1}
MGPU_CONFIGS = (
    {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 1},
    {"block_m": 128, "block_n": 256, "block_k": 64, "max_concurrent_steps": 4, "grid_block_n": 2},
    {"block_m": 64, "block_n": 128, "block_k": 64, "max_concurrent_steps": 5, "grid_block_n": 4},
)


def _kernels():
    """(ragged_dot, transposed_ragged_dot) of the installed JAX."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot, transposed_ragged_dot_mgpu.transposed_ragged_dot


def _call(fn, *args, **kwargs):
    accepted = inspect.signature(fn).parameters
    return fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})


# Tile configurations per matmul, the best of 56-72 by bench/tune_mgpu.py on an H200 at the bench
# shape (131,072 rows over 64 experts): (op, contraction or output-row dim, output-column dim) ->
# config, op "fwd" (x @ w), "dx" (g @ w^T) or "dw" (x_e^T g_e). Against MGPU there, per layer:
# 3.26 -> 2.57 ms for the six expert matmuls (gate|up 1024 -> 1024, down 512 -> 1024). A matmul not
# listed, or one whose dims the config does not tile, gets MGPU.
_T = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
MGPU_TUNED: dict[tuple[str, int, int], dict[str, int]] = {
    ("fwd", 1024, 1024): dict(zip(_T, (128, 128, 64, 6, 8))),  # 0.740 -> 0.552 ms
    ("dx", 1024, 1024): dict(zip(_T, (192, 128, 64, 4, 4))),   # 0.761 -> 0.543
    ("dw", 1024, 1024): dict(zip(_T, (128, 128, 64, 6, 1))),   # 0.560 -> 0.522
    ("fwd", 512, 1024): dict(zip(_T, (192, 128, 64, 4, 4))),   # 0.476 -> 0.375
    ("dx", 1024, 512): dict(zip(_T, (128, 128, 64, 6, 4))),    # 0.394 -> 0.288
    ("dw", 512, 1024): dict(zip(_T, (128, 128, 64, 6, 1))),    # 0.327 -> 0.286
}


class TunedTile(BaseModel):
    """One entry of a tile file (bench/tune_mgpu.py writes them): the matmul and its configuration."""

    model_config = ConfigDict(extra="forbid")
    op: Literal["fwd", "dx", "dw"]
    m: PositiveInt
    n: PositiveInt
    config: dict[Literal[_T], PositiveInt]

    @field_validator("config")
    @classmethod
    def _all_keys(cls, v: dict) -> dict:
        missing = sorted(set(_T) - set(v))
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        return v


@lru_cache(maxsize=None)
def load_tiles(path: str) -> dict[tuple[str, int, int], dict[str, int]]:
    """A tile file's entries ({"tiles": [TunedTile, ...]}) as MGPU_TUNED's keys and values; a file
    that cannot be read or does not fit raises OptionsError naming the file and the entry."""
    try:
        raw = json.loads(Path(path).read_text())
        entries = [TunedTile.model_validate(e) for e in raw["tiles"]]
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as err:
        raise OptionsError(f"MOE_LADDER_OPTIONS jax_mgpu_tiles={path}: not a tile file of bench/tune_mgpu.py "
                         f"({type(err).__name__}: {err})") from None
    return {(e.op, e.m, e.n): dict(e.config) for e in entries}


def mgpu_key(op: str, a, b, transpose_rhs: bool | None = None) -> tuple[str, int, int]:
    """(op, m, n) of one ragged dot, MGPU_TUNED's key: m the contraction width ("fwd", "dx") or
    the weight gradient's rows ("dw"), n the output's columns."""
    if op == "dw":
        return op, a.shape[1], b.shape[1]
    return op, a.shape[1], (b.shape[1] if transpose_rhs else b.shape[2])


# how the kernels are chosen: (EngineOptions.jax_mgpu, EngineOptions.jax_mgpu_tiles)
Choice = tuple[str, "str | None"]
TUNED: Choice = ("1", None)


def mgpu_config(op: str, a, b, transpose_rhs: bool | None = None, choice: Choice = TUNED) -> dict[str, int]:
    """The tile configuration of one ragged dot: _rd(a, b) for op "fwd"/"dx", _trd(a, b) for "dw".
    The entries of the tile file choice[1] (options.jax_mgpu_tiles: a file bench/tune_mgpu.py
    writes for your widths) come first, then MGPU_TUNED's; choice[0] "default"
    (options.jax_mgpu "default") ignores both."""
    key = mgpu_key(op, a, b, transpose_rhs)
    _, m, n = key
    mode, tiles = choice
    cfg = (load_tiles(tiles).get(key) if tiles else None) or MGPU_TUNED.get(key)
    if cfg is None or mode == "default":
        return dict(MGPU)
    fits = m % (cfg["block_m"] if op == "dw" else cfg["block_k"]) == 0
    fits = fits and (n % cfg["block_n"] == 0 if op == "dw" else True)
    return dict(cfg) if fits else dict(MGPU)


def _rd(x, w, sizes, choice: Choice, transpose_rhs=False):
    rd, _ = _kernels()
    cfg = mgpu_config("dx" if transpose_rhs else "fwd", x, w, transpose_rhs, choice)
    return _call(rd, x, w, group_sizes=sizes.astype(jnp.int32), transpose_rhs=transpose_rhs, **cfg)


def _trd(x, g, sizes, choice: Choice):
    _, trd = _kernels()
    cfg = mgpu_config("dw", x, g, choice=choice)
    return _call(trd, x, g, group_sizes=sizes.astype(jnp.int32), **cfg)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def mgpu_gmm(x_AK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, choice: Choice = TUNED) -> jax.Array:
    return _rd(x_AK, w_EKN, sizes_E, choice)


def _fwd(x_AK, w_EKN, sizes_E, choice):
    return _rd(x_AK, w_EKN, sizes_E, choice), (x_AK, w_EKN, sizes_E)


def _bwd(choice, res, g_AN):
    x_AK, w_EKN, sizes_E = res
    g_AN = g_AN.astype(x_AK.dtype)
    dx_AK = _rd(g_AN, w_EKN, sizes_E, choice, transpose_rhs=True)
    dw_EKN = _trd(x_AK, g_AN, sizes_E, choice)
    return dx_AK, dw_EKN.astype(w_EKN.dtype), None


mgpu_gmm.defvjp(_fwd, _bwd)


@lru_cache(maxsize=1)
def _on_hopper() -> bool:
    try:
        dev = jax.devices()[0]
        return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")
    except RuntimeError:  # no backend can start here (jaxlib's XlaRuntimeError is one)
        return False


def mgpu_usable(L: int, F: int, dtype, mode: str = "1") -> bool:
    """Whether dropless dispatch can use the kernels: a Hopper GPU, 16-bit compute, expert
    widths that tile (multiples of 128); mode "0" (options.jax_mgpu) turns them off
    ("default" keeps them with MGPU's tiles for every matmul)."""
    if mode == "0" or jnp.dtype(dtype).itemsize != 2:
        return False
    return L % 128 == 0 and F % 128 == 0 and _on_hopper()


# ---- permutations with gather backwards ------------------------------------------------------------
# A gather's own transpose is a scatter-add, which XLA runs with atomics (12 ms of a 140 ms step on
# an H200 for the dispatch alone); for a permutation the transpose is the inverse permutation, a
# gather.


def take_rows(x_NL: jax.Array, idx_M: jax.Array) -> jax.Array:
    """x_NL[idx_M]. Rows of a 16-bit dtype and even width move as 32-bit words (a bitcast on
    each side), which XLA's gather moves faster than the same bytes as 16-bit elements: on an
    H200 the dispatch's bf16 [16,384 x 1,024] -> [131,072 x 1,024] took 0.131 ms this way against
    0.179 ms (bench/jax_gather.py). A gather that feeds a reduction or a product is slower this
    way (0.09 -> 0.23 ms), since the bitcast keeps it out of the consumer's fusion, so only the
    dispatch uses it."""
    N, L = x_NL.shape
    if jnp.dtype(x_NL.dtype).itemsize != 2 or L % 2:
        return x_NL[idx_M]
    words_NW = lax.bitcast_convert_type(x_NL.reshape(N, L // 2, 2), jnp.uint32)
    return lax.bitcast_convert_type(words_NW[idx_M], x_NL.dtype).reshape(idx_M.shape[0], L)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x_TL: jax.Array, src_A: jax.Array, inv_A: jax.Array, K: int) -> jax.Array:
    """x_TL rows src_A (the token of each expert-sorted assignment) -> x_AL. Backward: the
    gradient back to (token, slot) order by the inverse permutation inv_A, K slots summed."""
    return take_rows(x_TL, src_A)


def _dispatch_fwd(x_TL, src_A, inv_A, K):
    return take_rows(x_TL, src_A), inv_A


def _dispatch_bwd(K, inv_A, g_AL):
    T = inv_A.shape[0] // K
    g_TL = jnp.sum(g_AL[inv_A].reshape(T, K, -1).astype(jnp.float32), axis=1)
    return g_TL.astype(g_AL.dtype), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def permute_rows(x_AL: jax.Array, idx_A: jax.Array, inv_A: jax.Array) -> jax.Array:
    """x_AL[idx_A] for a permutation idx_A whose inverse is inv_A; backward g[inv_A]."""
    return x_AL[idx_A]


def _permute_fwd(x_AL, idx_A, inv_A):
    return x_AL[idx_A], inv_A


def _permute_bwd(inv_A, g_AL):
    return g_AL[inv_A], None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def inverse_permutation(order_A: jax.Array) -> jax.Array:
    """inv with inv[order_A[a]] = a. The indices are unique, and saying so lets XLA write the
    scatter with plain stores."""
    pos_A = jnp.arange(order_A.shape[0], dtype=order_A.dtype)
    return jnp.zeros_like(order_A).at[order_A].set(pos_A, unique_indices=True)


def sorted_starts(sorted_A: jax.Array, n: int) -> jax.Array:
    """Where each of the values 0..n starts in the sorted array (n + 1 entries, the last A when every
    value is below n), by binary search: no scatter."""
    return jnp.searchsorted(sorted_A, jnp.arange(n + 1, dtype=sorted_A.dtype), side="left")


def sorted_counts(sorted_A: jax.Array, n: int) -> jax.Array:
    """How many of sorted_A's values equal each of 0..n-1 (int32): a bincount's scatter-add would
    pile A atomic updates onto n counters."""
    return jnp.diff(sorted_starts(sorted_A, n)).astype(jnp.int32)


def _with_zero_row(x_NL: jax.Array) -> jax.Array:
    return jnp.concatenate([x_NL, jnp.zeros((1, x_NL.shape[-1]), x_NL.dtype)], 0)


def partial_inverse(idx_M: jax.Array, N: int) -> jax.Array:
    """For each of N rows, the position in idx_M that names it (idx_M names each row of [0, N) at
    most once; N, the zero row, any number of times), or M where none does."""
    M = idx_M.shape[0]
    pos_M = jnp.arange(M, dtype=idx_M.dtype)
    # the zero row's readers each write a slot of their own past N: no two writes share an index
    # (XLA serialises a scatter's colliding writes)
    dest_M = jnp.where(idx_M < N, idx_M, N + pos_M)
    return jnp.full((N + M,), M, idx_M.dtype).at[dest_M].set(pos_M, unique_indices=True)[:N]


@jax.custom_vjp
def gather_rows(x_NL: jax.Array, idx_M: jax.Array, inv_N: jax.Array) -> jax.Array:
    """[x_NL; 0][idx_M] where every row of x is read at most once (inv_N = partial_inverse(idx_M, N)):
    the backward is the gather [g_ML; 0][inv_N]. The capacity transport's row maps send every
    dropped or empty row to one zero row; the plain gather's transpose is then a scatter-add whose
    atomics all land on that row."""
    return _with_zero_row(x_NL)[idx_M]


def _gather_rows_fwd(x_NL, idx_M, inv_N):
    return _with_zero_row(x_NL)[idx_M], inv_N


def _gather_rows_bwd(inv_N, g_ML):
    return _with_zero_row(g_ML)[inv_N], None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


# ---- the experts' SwiGLU and the gated combine, with 16-bit residuals ---------------------------
# Autodiff of the fp32 SwiGLU over the upcast gate|up product stores that fp32 [A, 2F] upcast for
# the backward, and autodiff of the combine an fp32 [A, L] copy of the expert outputs; both write
# fp32 [A, *] gradients that a convert then halves. These VJPs keep the 16-bit arrays the matmuls
# wrote and compute in fp32 inside each fusion.


def _halves_fp32(gu_A2F: jax.Array) -> tuple[jax.Array, jax.Array]:
    F = gu_A2F.shape[-1] // 2
    return gu_A2F[:, :F].astype(jnp.float32), gu_A2F[:, F:].astype(jnp.float32)


def swiglu_fp32(gu_A2F: jax.Array) -> jax.Array:
    """silu(gate) * up of a [A, 2F] gate|up product, in fp32, returned in gu's dtype (autodiff of
    it stores the fp32 halves: JaxKernels.experts "autodiff")."""
    g_AF, u_AF = _halves_fp32(gu_A2F)
    return (jax.nn.silu(g_AF) * u_AF).astype(gu_A2F.dtype)


swiglu = jax.custom_vjp(swiglu_fp32)  # the same, with gu itself as the residual


def _swiglu_fwd(gu_A2F):
    return swiglu_fp32(gu_A2F), gu_A2F


def _swiglu_bwd(gu_A2F, dh_AF):
    g_AF, u_AF = _halves_fp32(gu_A2F)
    dh_AF = dh_AF.astype(jnp.float32)
    s_AF = jax.nn.sigmoid(g_AF)
    dg_AF = dh_AF * u_AF * s_AF * (1.0 + g_AF * (1.0 - s_AF))
    du_AF = dh_AF * g_AF * s_AF
    return (jnp.concatenate([dg_AF, du_AF], -1).astype(gu_A2F.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def _by_token(y_sorted_AL, inv_A, K):
    """The sorted rows in (token, slot) order, [T, K, L] in fp32."""
    return y_sorted_AL[inv_A].reshape(-1, K, y_sorted_AL.shape[-1]).astype(jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def combine(y_sorted_AL: jax.Array, gate_TK: jax.Array, inv_A: jax.Array, order_A: jax.Array, K: int) -> jax.Array:
    """y_TL = sum_k gate_TK[t, k] * y_sorted_AL[inv_A[t K + k]] in fp32: the expert-sorted outputs
    back to (token, slot) order (order_A the sort, inv_A its inverse) and gated. Backward: the
    gates' gradient by the same gather, the outputs' by the gather through order_A, in y's dtype."""
    return jnp.sum(_by_token(y_sorted_AL, inv_A, K) * gate_TK[..., None], axis=1)


def _combine_fwd(y_sorted_AL, gate_TK, inv_A, order_A, K):
    return combine(y_sorted_AL, gate_TK, inv_A, order_A, K), (y_sorted_AL, gate_TK, inv_A, order_A)


def _combine_bwd(K, res, g_TL):
    y_sorted_AL, gate_TK, inv_A, order_A = res
    dgate_TK = jnp.sum(_by_token(y_sorted_AL, inv_A, K) * g_TL[:, None, :], axis=-1)
    dy_sorted_AL = (g_TL[order_A // K] * gate_TK.reshape(-1)[order_A][:, None]).astype(y_sorted_AL.dtype)
    return dy_sorted_AL, dgate_TK, None, None


combine.defvjp(_combine_fwd, _combine_bwd)


def dropless_mgpu(x_TL, expert_TK, gate_TK, wg_ELF, wu_ELF, wd_EFL, dtype, choice: Choice = TUNED,
                  vjp: bool = True) -> jax.Array:
    """Dropless experts (the contract of moe.dropless_experts): assignments sorted by expert,
    SwiGLU through three grouped matmuls, outputs back in (token, slot) order, gated sum in fp32.
    `vjp` (JaxKernels.experts "vjp"): the SwiGLU and the combine through swiglu and combine above;
    else by autodiff of their fp32 forms."""
    T, K = expert_TK.shape
    E = wg_ELF.shape[0]
    e_A = expert_TK.reshape(-1)  # token-major: a = t*K + j
    order_A = jnp.argsort(e_A, stable=True)
    sizes_E = sorted_counts(e_A[order_A], E)
    inv_A = inverse_permutation(order_A)
    x_AL = dispatch_rows(x_TL.astype(dtype), order_A // K, inv_A, K)
    # gate and up as one [E, L, 2F] matmul: wider tiles, one dx matmul in the backward
    gu_A2F = mgpu_gmm(x_AL, jnp.concatenate([wg_ELF, wu_ELF], -1).astype(dtype), sizes_E, choice)
    y_sorted_AL = mgpu_gmm((swiglu if vjp else swiglu_fp32)(gu_A2F), wd_EFL.astype(dtype), sizes_E, choice)
    if vjp:
        return combine(y_sorted_AL, gate_TK, inv_A, order_A, K)
    y_AL = permute_rows(y_sorted_AL, inv_A, order_A).astype(jnp.float32)
    return jnp.sum(y_AL.reshape(T, K, -1) * gate_TK[..., None], axis=1)
