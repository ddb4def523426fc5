"""Routed experts: the router, dropless dispatch (tokens sorted by expert, grouped matmul) and
capacity dispatch with the pooled-wave transport of the expert-parallel all-to-all.

The capacity transport is one per-shard function written against a named axis `ep`. It runs
either under shard_map over a real device mesh (jax.lax.all_to_all between devices) or under
jax.vmap with the same axis name on one device (the emulated shards): the drops are the same
by construction, since it is the same code.

Shape legend: T tokens, t tokens of one source shard, D model, L expert width (latent or D),
E routed experts, e experts of one shard, K top-k, F expert hidden, A assignments (t*K),
W waves, P ep shards, C sender pool rows, X arrivals at one shard (W*P*C), R receiver rows.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from engines import dispatch_ref
from engines.jax import fast
from engines.jax.model import ModelConfig, Params, einsum, mm

EP_AXIS = "ep"


# ---- router -------------------------------------------------------------------------------


def pick(scores_TE: jax.Array, expert_TK: jax.Array) -> jax.Array:
    """scores_TE[t, expert_TK[t, k]] as a masked sum over a one-hot [T, K, E]: the same values
    (one term, the rest exact zeros), and a transpose that is elementwise. take_along_axis's
    transpose is a scatter-add into [T, E], which XLA runs with atomics (1.8 ms of a 97 ms step
    on an H200 at 64 experts; the step ran 0.9% faster with this)."""
    hit_TKE = expert_TK[..., None] == jnp.arange(scores_TE.shape[-1], dtype=expert_TK.dtype)
    return jnp.sum(jnp.where(hit_TKE, scores_TE[:, None, :], 0), axis=-1)


def route(h_TD: jax.Array, router_DE: jax.Array, bias_E: jax.Array, cfg: ModelConfig, seq_len: int):
    """Top-k choices, their gates and the router statistics of one layer.

    Selection uses scores + balancing bias; gates use the scores alone (the bias only steers
    which experts are picked)."""
    T = h_TD.shape[0]
    E, K = cfg.n_experts, cfg.top_k
    logits_TE = jnp.matmul(h_TD.astype(jnp.float32), router_DE, preferred_element_type=jnp.float32)  # fp32 routing
    if cfg.router_kind == "softmax":
        scores_TE = jax.nn.softmax(logits_TE, axis=-1)
    else:
        scores_TE = jax.nn.sigmoid(logits_TE)
    select_TE = scores_TE + bias_E if cfg.bias_balancing else scores_TE
    _, expert_TK = lax.top_k(lax.stop_gradient(select_TE), K)
    if cfg.kernels.gates == "pick":
        gate_TK = pick(scores_TE, expert_TK)
    else:
        gate_TK = jnp.take_along_axis(scores_TE, expert_TK, axis=-1)
    if cfg.router_kind == "sigmoid":
        gate_TK = gate_TK / jnp.sum(gate_TK, axis=-1, keepdims=True)
    # probabilities over experts for balancing and entropy (sigmoid scores normalised per token)
    probs_TE = scores_TE if cfg.router_kind == "softmax" else scores_TE / jnp.sum(scores_TE, -1, keepdims=True)
    onehot_TE = jnp.sum(jax.nn.one_hot(expert_TK, E, dtype=h_TD.dtype), axis=1)
    load_E = jnp.sum(onehot_TE, axis=0)
    if cfg.balance_scope == "sequence":
        n_seq = T // seq_len
        f_BE = jnp.sum(onehot_TE.reshape(n_seq, seq_len, E), axis=1) / (seq_len * K)
        p_BE = jnp.mean(probs_TE.reshape(n_seq, seq_len, E), axis=1)
        aux = E * jnp.mean(jnp.sum(f_BE * p_BE, axis=-1))
    else:
        aux = E * jnp.sum((load_E / (T * K)) * jnp.mean(probs_TE, axis=0))
    router_z = jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)
    entropy = jnp.mean(-jnp.sum(probs_TE * jnp.log(jnp.clip(probs_TE, 1e-20)), axis=-1))
    stats = {"aux": aux, "router_z": router_z, "entropy": lax.stop_gradient(entropy), "load": load_E}
    return expert_TK, gate_TK, stats


# ---- dropless -----------------------------------------------------------------------------


def _block_rows(n_assign: int, n_experts: int) -> int:
    """Rows per block of the grouped matmul: about a quarter of an expert's mean share, a power
    of two in [8, 512], so the padding (at most block - 1 rows per expert) stays small."""
    want = max(n_assign // (4 * n_experts), 1)
    return int(min(max(1 << (want.bit_length() - 1), 8), 512))


def dropless_experts(x_TL, expert_TK, gate_TK, wg_ELF, wu_ELF, wd_EFL, dtype=jnp.float32,
                     mgpu: fast.Choice = fast.TUNED, vjp: bool = True) -> jax.Array:
    """Every assignment is computed: rows sorted by expert, each expert's rows padded to whole
    blocks, one batched matmul over blocks (each block multiplies its own expert's weights).
    Static shapes: at most A + E * (block - 1) rows, whatever the routing. On a Hopper GPU in
    bf16 the Mosaic-GPU ragged dot kernels do it instead (engines/jax/fast.py; `mgpu`: how they
    are chosen; `vjp`: their SwiGLU and combine as custom VJPs)."""
    if fast.mgpu_usable(wg_ELF.shape[1], wg_ELF.shape[2], dtype, mgpu[0]):
        return fast.dropless_mgpu(x_TL, expert_TK, gate_TK, wg_ELF, wu_ELF, wd_EFL, dtype, mgpu, vjp)
    T, K = expert_TK.shape
    E, L = wg_ELF.shape[0], x_TL.shape[-1]
    A = T * K
    block = _block_rows(A, E)
    n_blocks = -(-(A + E * (block - 1)) // block)
    e_A = expert_TK.reshape(-1)  # token-major: a = t*K + j
    order_A = jnp.argsort(e_A, stable=True)
    sizes_E = jnp.bincount(e_A, length=E)
    padded_E = -(-sizes_E // block) * block
    pad_end_E = jnp.cumsum(padded_E)
    e_sorted_A = e_A[order_A]
    row_A = (pad_end_E - padded_E)[e_sorted_A] + jnp.arange(A) - (jnp.cumsum(sizes_E) - sizes_E)[e_sorted_A]
    x_NL = jnp.zeros((n_blocks * block, L), dtype).at[row_A].set(x_TL[order_A // K].astype(dtype))
    # expert of each block; blocks past the last expert's rows are empty (zero rows, any weights)
    blk_B = jnp.minimum(jnp.searchsorted(pad_end_E, jnp.arange(n_blocks) * block, side="right"), E - 1)
    x_BnL = x_NL.reshape(n_blocks, block, L)

    def per_block(w_E__):  # gathered in fp32: the gather's transpose sums an expert's blocks in fp32
        return w_E__.astype(jnp.float32)[blk_B]

    h_BnF = jax.nn.silu(einsum("bnl,blf->bnf", x_BnL, per_block(wg_ELF), dtype))
    h_BnF = h_BnF * einsum("bnl,blf->bnf", x_BnL, per_block(wu_ELF), dtype)
    y_NL = einsum("bnf,bfl->bnl", h_BnF, per_block(wd_EFL), dtype).reshape(n_blocks * block, L)
    y_AL = jnp.zeros((A, L), jnp.float32).at[order_A].set(y_NL[row_A])
    return jnp.sum(y_AL.reshape(T, K, L) * gate_TK[..., None], axis=1)


# ---- capacity: the pooled-wave transport ------------------------------------------------------


def capacities(cfg: ModelConfig, n_tokens: int) -> tuple[int, int]:
    """(C_send rows per (source, destination) pool per wave, C_recv rows per expert): the one
    formula of engines/dispatch_ref.py, shared with the other engine."""
    return dispatch_ref.capacities(n_tokens, cfg.top_k, cfg.n_experts, cfg.ep_size, cfg.n_waves,
                                   cfg.cf_send, cfg.cf_recv)


def _rank_within(key_X: jax.Array, n_keys: int, valid_X: jax.Array) -> jax.Array:
    """For each row, how many earlier valid rows share its key (rows are in priority order).
    A stable sort by key, then position minus the key's start: O(X log X) for any key count."""
    X = key_X.shape[0]
    key_X = jnp.where(valid_X, key_X, n_keys)  # invalid rows form a group of their own, last
    order_X = jnp.argsort(key_X, stable=True)
    sorted_X = key_X[order_X]
    starts_G = fast.sorted_starts(sorted_X, n_keys)
    rank_sorted_X = jnp.arange(X) - starts_G[sorted_X]
    return jnp.zeros_like(rank_sorted_X).at[order_X].set(rank_sorted_X, unique_indices=True)


def pooled_wave_shard(x_tL, expert_tK, gate_tK, wg_eLF, wu_eLF, wd_eFL, *, ep, n_waves, c_send, c_recv,
                      dtype=jnp.float32):
    """One source/destination shard of the transport; collectives over the axis EP_AXIS.

    Sender: assignments in priority order (slot-major, then token) fill one pool per destination
    shard and wave; the expert id (local to its destination) rides in the last payload column.
    Receiver: arrivals ranked per local expert in (wave, source, row) order, at most c_recv kept.
    Rows travel in the compute dtype (bf16 halves the bytes) unless a local expert id would not be
    exact in it. Returns this shard's expert output (fp32) and the global (psum) send and receive
    drop counts."""
    t, K = expert_tK.shape
    L = x_tL.shape[-1]
    e_local = wg_eLF.shape[0]
    wire = dtype if e_local <= 256 else jnp.float32  # bf16 holds every integer up to 256 exactly
    x_tL = x_tL.astype(wire)
    # sender ----------------------------------------------------------------------------------
    e_A = expert_tK.T.reshape(-1)  # slot-major: a = j*t + token
    dst_A = e_A // e_local
    pos_A = _rank_within(dst_A, ep, jnp.ones_like(dst_A, dtype=bool))
    sent_A = pos_A < n_waves * c_send
    # every row map below is a gather whose backward is a gather by its partial inverse: a
    # scatter, or a plain gather's transpose, would pile every empty or dropped row's update onto
    # one row with atomics. Pool slots are numbered (wave, destination, row); n_slots: none.
    n_slots = n_waves * ep * c_send
    at_A = jnp.where(sent_A, ((pos_A // c_send) * ep + dst_A) * c_send + pos_A % c_send, n_slots)
    filler_S = fast.partial_inverse(at_A, n_slots)  # the assignment filling each slot (A: none)
    ids_S = jnp.concatenate([e_A - dst_A * e_local, jnp.full((1,), -1, e_A.dtype)])[filler_S]
    # each assignment's token row (slot-major: a tile, whose transpose sums the K slots)
    x_SL = fast.gather_rows(jnp.tile(x_tL, (K, 1)), filler_S, at_A)
    send_WPCL1 = jnp.concatenate([x_SL, ids_S[:, None].astype(wire)], -1).reshape(n_waves, ep, c_send, L + 1)
    # one all-to-all per wave, every wave the same shape: [P dst, C, L+1] -> [P src, C, L+1]
    recv_WPCL1 = jnp.stack([lax.all_to_all(send_WPCL1[w], EP_AXIS, 0, 0) for w in range(n_waves)])
    # receiver --------------------------------------------------------------------------------
    arr_XL1 = recv_WPCL1.reshape(n_slots, L + 1)  # (wave, source, row) order
    le_X = lax.stop_gradient(arr_XL1[:, L]).astype(jnp.int32)
    valid_X = le_X >= 0
    rank_X = _rank_within(le_X, e_local, valid_X)
    kept_X = valid_X & (rank_X < c_recv)
    n_buf = e_local * c_recv
    slot_X = jnp.where(kept_X, le_X * c_recv + rank_X, n_buf)  # each arrival's buffer row (n_buf: dropped)
    filler_B = fast.partial_inverse(slot_X, n_buf)  # the arrival filling each buffer row
    buf_eRL = fast.gather_rows(arr_XL1[:, :L], filler_B, slot_X).reshape(e_local, c_recv, L)
    gate_eRF = jax.nn.silu(einsum("erl,elf->erf", buf_eRL, wg_eLF, dtype))
    h_eRF = gate_eRF * einsum("erl,elf->erf", buf_eRL, wu_eLF, dtype)
    out_eRL = einsum("erf,efl->erl", h_eRF, wd_eFL, dtype).astype(wire)
    y_XL = fast.gather_rows(out_eRL.reshape(n_buf, L), slot_X, filler_B)  # unkept arrivals: zero rows
    y_WPCL = y_XL.reshape(n_waves, ep, c_send, L)
    back_WPCL = jnp.stack([lax.all_to_all(y_WPCL[w], EP_AXIS, 0, 0) for w in range(n_waves)])
    # back at the sender: each assignment reads its row (zero if dropped on either side)
    y_AL = fast.gather_rows(back_WPCL.reshape(n_slots, L), at_A, filler_S)
    y_tL = jnp.sum(y_AL.reshape(K, t, L).astype(jnp.float32) * gate_tK.T[..., None], axis=0)
    n_send = lax.psum(jnp.sum(~sent_A).astype(jnp.float32), EP_AXIS)
    n_recv = lax.psum(jnp.sum(valid_X & ~kept_X).astype(jnp.float32), EP_AXIS)
    return y_tL, n_send, n_recv


def capacity_experts(x_TL, expert_TK, gate_TK, wg_ELF, wu_ELF, wd_EFL, cfg: ModelConfig, mesh: Mesh | None):
    """Pooled-wave capacity dispatch over cfg.ep_size shards: real devices when `mesh` is given,
    otherwise emulated on one device. Returns (y_TL, send drops, receive drops)."""
    T, K = expert_TK.shape
    ep = cfg.ep_size
    c_send, c_recv = capacities(cfg, T)
    shard = partial(pooled_wave_shard, ep=ep, n_waves=cfg.n_waves, c_send=c_send, c_recv=c_recv, dtype=cfg.dtype)
    if mesh is not None:
        fn = jax.shard_map(
            shard,
            mesh=mesh,
            in_specs=(P(EP_AXIS), P(EP_AXIS), P(EP_AXIS), P(EP_AXIS), P(EP_AXIS), P(EP_AXIS)),
            out_specs=(P(EP_AXIS), P(), P()),
        )
        return fn(x_TL, expert_TK, gate_TK, wg_ELF, wu_ELF, wd_EFL)

    def split(a):
        return a.reshape(ep, a.shape[0] // ep, *a.shape[1:])

    y_PtL, n_send, n_recv = jax.vmap(shard, axis_name=EP_AXIS)(
        split(x_TL), split(expert_TK), split(gate_TK), split(wg_ELF), split(wu_ELF), split(wd_EFL)
    )
    return y_PtL.reshape(T, -1), n_send[0], n_recv[0]


# ---- the MoE layer ------------------------------------------------------------------------------


def make_moe_fn(cfg: ModelConfig, seq_len: int, mesh: Mesh | None = None):
    """moe_fn(params, buffers, block_prefix, h_TD) -> (routed output [T, D], stats) for forward()."""

    def moe_fn(p: Params, buffers: Params, b: str, h_TD: jax.Array):
        T = h_TD.shape[0]
        expert_TK, gate_TK, stats = route(h_TD, p[f"{b}.moe.router"], buffers[f"{b}.moe.router_bias"], cfg, seq_len)
        x_TL = mm(h_TD, p[f"{b}.moe.latent_down"], cfg.dtype) if cfg.latent_dim is not None else h_TD
        w = (p[f"{b}.moe.experts.w_gate"], p[f"{b}.moe.experts.w_up"], p[f"{b}.moe.experts.w_down"])
        if cfg.dispatch == "capacity":
            y_TL, n_send, n_recv = capacity_experts(x_TL, expert_TK, gate_TK, *w, cfg, mesh)
        else:
            y_TL = dropless_experts(x_TL, expert_TK, gate_TK, *w, dtype=cfg.dtype, mgpu=(cfg.mgpu, cfg.mgpu_tiles),
                                    vjp=cfg.kernels.experts == "vjp")
            n_send = n_recv = jnp.zeros((), jnp.float32)
        y_TD = mm(y_TL, p[f"{b}.moe.latent_up"], cfg.dtype) if cfg.latent_dim is not None else y_TL
        n_assign = T * cfg.top_k
        stats = dict(stats, drop_send=n_send / n_assign, drop_recv=n_recv / n_assign)
        return y_TD, stats

    return moe_fn
