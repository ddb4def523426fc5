"""The MoE transformer of a spec, in PyTorch. Module paths are the engine-neutral parameter
names of engines/base.py (state_dict() keys are exactly those names, x @ w layouts), so a
checkpoint is the state dict itself.

Per block: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)), where
- attention: GQA (query head h reads kv head h // (H / KV)), rotary embeddings on the (first
  half, second half) pairs of each head, causal, optionally a sliding window (query i sees keys
  i - window < j <= i);
- moe: router logits (fp32) -> softmax or sigmoid scores; selection = top-k of scores (+ the
  balancing bias when model.router_bias_balancing; the bias steers the choice only); gates =
  scores of the chosen experts (sigmoid gates renormalised to sum 1 per token, softmax gates
  not); the routed experts (SwiGLU) run inside the latent width (latent_down before, latent_up
  after), shared experts (SwiGLU) on every token, outputs summed.
Loss = CE + optim.z_loss * mean(logsumexp(logits)^2) + optim.aux_loss * aux
       + optim.router_z_loss * router_z, aux and router_z averaged over layers;
aux (Switch) = E * sum_e f_e * p_e, f_e = share of the T*K assignments picking e, p_e = mean router
probability of e (sigmoid scores normalised per token), over the batch or per sequence (then
averaged) by model.balance_scope; router_z = mean(logsumexp(router logits)^2).

Dispatch: "dropless" sorts the assignments by expert and runs a grouped matmul (torch._grouped_mm
on CUDA in bf16, a loop over experts elsewhere); "capacity" follows the pooled-wave semantics
written out in engines/dispatch_ref.py (sender pools per shard pair and wave, a receiver bound per
expert), emulating the EP shards on one device with fixed-shape [E, C_recv, L] expert buffers. Both combine an assignment's output
in (token, slot) order, so capacity with no drops equals dropless. Routing metadata stays on the
device: no host sync inside the forward pass except the CPU expert loop.

Shape legend: B batch, S sequence, T tokens (B*S), D model, H heads, G kv heads, Q head dim,
V vocab, E routed experts, K top-k, L expert width (latent or D), F expert hidden, N shared
experts, R shared hidden, A assignments (T*K), C receiver rows per expert.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engines.dispatch_ref import capacities
from engines.params import init_arrays, tensor_shapes
from core.spec import ModelSpec

# ---- parameters ---------------------------------------------------------------------------------


def param_shapes(m: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, by engine-neutral name, in a fixed order (the init order)."""
    return tensor_shapes(
        n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        vocab_size=m.vocab_size, n_experts=m.n_routed_experts, expert_dim=m.expert_dim, expert_hidden=m.expert_hidden,
        latent_dim=m.latent_dim, n_shared=m.n_shared_experts, shared_hidden=m.shared_hidden)


def init_params(m: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """Deterministic initial weights (float32 numpy), the same in every engine (engines.params)."""
    return init_arrays(param_shapes(m), m.init_std, m.n_layers, seed)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape))


# ---- layers ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # the statistic in fp32 whatever the compute dtype
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [S, Q/2], computed in float64 then rounded, so every engine gets the same table."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
    return (torch.tensor(np.cos(ang), dtype=torch.float32, device=device),
            torch.tensor(np.sin(ang), dtype=torch.float32, device=device))


def apply_rope(x_BHSQ: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor) -> torch.Tensor:
    half = x_BHSQ.shape[-1] // 2
    x1, x2 = x_BHSQ[..., :half], x_BHSQ[..., half:]
    cos, sin = cos_SP.to(x_BHSQ.dtype), sin_SP.to(x_BHSQ.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_mask(seq_len: int, window: int | None, device) -> torch.Tensor | None:
    """[S, S] bool, True where query i may attend key j; None for plain causal (flash path)."""
    if window is None or window >= seq_len:
        return None
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & (i - j < window)


class Attention(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.H, self.G, self.Q = m.n_heads, m.n_kv_heads, m.head_dim
        self.wq = _param(m.d_model, self.H * self.Q)
        self.wk = _param(m.d_model, self.G * self.Q)
        self.wv = _param(m.d_model, self.G * self.Q)
        self.wo = _param(self.H * self.Q, m.d_model)

    def forward(self, x_BSD, cos, sin, mask_SS):
        B, S, _ = x_BSD.shape
        q_BHSQ = (x_BSD @ self.wq).view(B, S, self.H, self.Q).transpose(1, 2)
        k_BGSQ = (x_BSD @ self.wk).view(B, S, self.G, self.Q).transpose(1, 2)
        v_BGSQ = (x_BSD @ self.wv).view(B, S, self.G, self.Q).transpose(1, 2)
        q_BHSQ, k_BGSQ = apply_rope(q_BHSQ, cos, sin), apply_rope(k_BGSQ, cos, sin)
        gqa = self.G != self.H
        if mask_SS is None:
            o_BHSQ = F.scaled_dot_product_attention(q_BHSQ, k_BGSQ, v_BGSQ, is_causal=True, enable_gqa=gqa)
        else:
            o_BHSQ = F.scaled_dot_product_attention(q_BHSQ, k_BGSQ, v_BGSQ, attn_mask=mask_SS, enable_gqa=gqa)
        return o_BHSQ.transpose(1, 2).reshape(B, S, self.H * self.Q) @ self.wo


# ---- routed experts -------------------------------------------------------------------------------


class Experts(nn.Module):
    def __init__(self, E: int, L: int, Fh: int):
        super().__init__()
        self.w_gate = _param(E, L, Fh)
        self.w_up = _param(E, L, Fh)
        self.w_down = _param(E, Fh, L)

    def grouped(self, x_AL: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """SwiGLU over rows already sorted by expert, counts_E rows per expert."""
        if _use_grouped_mm(x_AL, self.w_gate):
            offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
            xb = x_AL.to(torch.bfloat16)
            wg, wu, wd = (w.to(torch.bfloat16) for w in (self.w_gate, self.w_up, self.w_down))
            h_AF = F.silu(torch._grouped_mm(xb, wg, offs=offs_E)) * torch._grouped_mm(xb, wu, offs=offs_E)
            return torch._grouped_mm(h_AF, wd, offs=offs_E).to(x_AL.dtype)
        outs, start = [], 0
        for e, n in enumerate(counts_E.tolist()):  # CPU: the host already holds the counts
            x = x_AL[start : start + n]
            outs.append((F.silu(x @ self.w_gate[e]) * (x @ self.w_up[e])) @ self.w_down[e])
            start += n
        return torch.cat(outs, 0)

    def padded(self, x_ECL: torch.Tensor) -> torch.Tensor:
        """SwiGLU over fixed-shape per-expert buffers [E, C, L]."""
        h_ECF = F.silu(torch.bmm(x_ECL, self.w_gate.to(x_ECL.dtype))) * torch.bmm(x_ECL, self.w_up.to(x_ECL.dtype))
        return torch.bmm(h_ECF, self.w_down.to(x_ECL.dtype))


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # the CUDA kernel wants bf16 and 16-byte aligned rows; its CPU fallback lacks a stable backward
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and torch.is_autocast_enabled("cuda")
            and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0)


def group_counts(group_A: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Rows per group (int64) by scatter-add: CUDA's bincount reads its maximum back to the host."""
    return torch.zeros(n_groups, dtype=torch.long, device=group_A.device).scatter_add_(
        0, group_A, torch.ones_like(group_A))


def _rank_within_groups(group_A: torch.Tensor, n_groups: int) -> torch.Tensor:
    """How many earlier rows (in the given order) share each row's group; stays on the device."""
    A = group_A.shape[0]
    order_A = torch.argsort(group_A, stable=True)
    counts_G = group_counts(group_A, n_groups)
    starts_G = torch.cumsum(counts_G, 0) - counts_G
    rank_sorted = torch.arange(A, device=group_A.device) - starts_G[group_A[order_A]]
    return torch.empty_like(rank_sorted).scatter_(0, order_A, rank_sorted)


def capacity_plan(expert_TK: torch.Tensor, n_experts: int, ep: int, n_waves: int, cf_send: float,
                  cf_recv: float) -> dict[str, torch.Tensor | int]:
    """Pooled-wave bookkeeping on the device (same rules as engines/dispatch_ref.py):
    kept_TK, send_drop_TK, recv_drop_TK (bool), slot_TK (row e * C + rank in the [E*C] expert
    buffers; E*C, one past the end, for dropped assignments), c_send, c_recv."""
    T, K = expert_TK.shape
    E = n_experts
    c_send, c_recv = capacities(T, K, E, ep, n_waves, cf_send, cf_recv)
    dev = expert_TK.device
    # priority order: slot-major, then token (p = j * T + t)
    e_P = expert_TK.t().reshape(-1)
    t_P = torch.arange(T, device=dev).repeat(K)
    src_P = t_P // (T // ep)
    dst_P = e_P // (E // ep)
    pos_P = _rank_within_groups(src_P * ep + dst_P, ep * ep)
    send_drop_P = pos_P >= n_waves * c_send
    wave_P, row_P = pos_P // c_send, pos_P % c_send
    # arrivals at an expert in (wave, source, row) order; send-dropped rows sort after all arrivals
    n_keys = n_waves * ep * c_send
    key_P = torch.where(send_drop_P, torch.full_like(pos_P, n_keys), (wave_P * ep + src_P) * c_send + row_P)
    order_P = torch.argsort(e_P * (n_keys + 1) + key_P, stable=True)
    counts_E = group_counts(e_P, E)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_sorted = torch.arange(T * K, device=dev) - starts_E[e_P[order_P]]
    rank_P = torch.empty_like(rank_sorted).scatter_(0, order_P, rank_sorted)
    recv_drop_P = ~send_drop_P & (rank_P >= c_recv)
    kept_P = ~send_drop_P & ~recv_drop_P
    slot_P = torch.where(kept_P, e_P * c_recv + rank_P, torch.full_like(rank_P, E * c_recv))

    def tk(a_P):
        return a_P.view(K, T).t()

    return {"kept_TK": tk(kept_P), "send_drop_TK": tk(send_drop_P), "recv_drop_TK": tk(recv_drop_P),
            "slot_TK": tk(slot_P), "c_send": c_send, "c_recv": c_recv}


class SharedExperts(nn.Module):
    def __init__(self, N: int, D: int, R: int):
        super().__init__()
        self.w_gate = _param(N, D, R)
        self.w_up = _param(N, D, R)
        self.w_down = _param(N, R, D)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        h_NTR = F.silu(torch.einsum("td,ndr->ntr", x_TD, self.w_gate)) * torch.einsum("td,ndr->ntr", x_TD, self.w_up)
        return torch.einsum("ntr,nrd->td", h_NTR, self.w_down)


class MoE(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.m = m
        E = m.n_routed_experts
        self.router = _param(m.d_model, E)
        self.register_buffer("router_bias", torch.zeros(E))
        if m.latent_dim is not None:
            self.latent_down = _param(m.d_model, m.latent_dim)
            self.latent_up = _param(m.latent_dim, m.d_model)
        self.experts = Experts(E, m.expert_dim, m.expert_hidden)
        if m.n_shared_experts > 0:
            self.shared = SharedExperts(m.n_shared_experts, m.d_model, m.shared_hidden)

    def route(self, x_TD: torch.Tensor, seq_len: int, logits_TE: torch.Tensor | None = None):
        """(expert_TK, gate_TK, stats); logits_TE: the router logits if the caller computed them."""
        m = self.m
        T, E, K = x_TD.shape[0], m.n_routed_experts, m.top_k
        if logits_TE is None:
            with torch.autocast(x_TD.device.type, enabled=False):  # routing decisions in fp32
                logits_TE = x_TD.float() @ self.router.float()
        scores_TE = torch.softmax(logits_TE, -1) if m.router_kind == "softmax" else torch.sigmoid(logits_TE)
        select_TE = scores_TE + self.router_bias if m.router_bias_balancing else scores_TE
        expert_TK = torch.topk(select_TE.detach(), K, dim=-1).indices
        gate_TK = scores_TE.gather(1, expert_TK)
        if m.router_kind == "sigmoid":
            gate_TK = gate_TK / gate_TK.sum(-1, keepdim=True)
        probs_TE = scores_TE if m.router_kind == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
        chosen_TE = torch.zeros(T, E, device=x_TD.device).scatter_add_(
            1, expert_TK, torch.ones(T, K, device=x_TD.device))
        load_E = chosen_TE.sum(0)
        if m.balance_scope == "sequence":
            n_seq = T // seq_len
            f_BE = chosen_TE.view(n_seq, seq_len, E).sum(1) / (seq_len * K)
            p_BE = probs_TE.view(n_seq, seq_len, E).mean(1)
            aux = E * (f_BE * p_BE).sum(-1).mean()
        else:
            aux = E * ((load_E / (T * K)) * probs_TE.mean(0)).sum()
        router_z = torch.logsumexp(logits_TE, -1).square().mean()
        entropy = -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(-1).mean()
        stats = {"aux": aux, "router_z": router_z, "entropy": entropy.detach(), "load": load_E}
        return expert_TK, gate_TK, stats

    def forward(self, x_TD: torch.Tensor, seq_len: int):
        m = self.m
        T, K = x_TD.shape[0], m.top_k
        expert_TK, gate_TK, stats = self.route(x_TD, seq_len)
        x_TL = x_TD @ self.latent_down if m.latent_dim is not None else x_TD
        if m.dispatch == "capacity":
            y_TKL, n_send, n_recv = self._capacity(x_TL, expert_TK)
        else:
            y_TKL = self._dropless(x_TL, expert_TK)
            n_send = n_recv = torch.zeros((), device=x_TD.device)
        y_TL = (y_TKL * gate_TK.unsqueeze(-1).to(y_TKL.dtype)).sum(1)
        y_TD = y_TL @ self.latent_up if m.latent_dim is not None else y_TL
        if m.n_shared_experts > 0:
            y_TD = y_TD + self.shared(x_TD)
        stats["drop_send"] = n_send / (T * K)
        stats["drop_recv"] = n_recv / (T * K)
        return y_TD, stats

    def _dropless(self, x_TL: torch.Tensor, expert_TK: torch.Tensor) -> torch.Tensor:
        T, K = expert_TK.shape
        e_A = expert_TK.reshape(-1)  # token-major: a = t * K + j
        order_A = torch.argsort(e_A, stable=True)
        counts_E = group_counts(e_A, self.m.n_routed_experts)
        y_sorted_AL = self.experts.grouped(x_TL[order_A // K], counts_E)
        y_AL = torch.empty_like(y_sorted_AL).index_copy(0, order_A, y_sorted_AL)
        return y_AL.view(T, K, -1)

    def _capacity(self, x_TL: torch.Tensor, expert_TK: torch.Tensor):
        m = self.m
        T, K = expert_TK.shape
        E, L = m.n_routed_experts, x_TL.shape[-1]
        plan, slot_A, fill_R = capacity_rows(m, expert_TK)
        C = plan["c_recv"]
        x_A1L = torch.cat([x_TL.repeat_interleave(K, 0), x_TL.new_zeros(1, L)], 0)
        buf_ECL = x_A1L[fill_R].view(E, C, L)
        out_ECL = self.experts.padded(buf_ECL)
        out_flat = torch.cat([out_ECL.reshape(E * C, L), out_ECL.new_zeros(1, L)], 0)
        y_TKL = out_flat[slot_A].view(T, K, L)  # dropped assignments read the zero row
        return y_TKL, plan["send_drop_TK"].sum().float(), plan["recv_drop_TK"].sum().float()


def partial_inverse(idx_M: torch.Tensor, N: int) -> torch.Tensor:
    """For each of N rows, the position in idx_M that names it (idx_M names each row of [0, N) at
    most once; N, a zero row, any number of times), or M where none does."""
    M = idx_M.shape[0]
    inv = torch.full((N + 1,), M, dtype=torch.long, device=idx_M.device)
    inv.scatter_(0, idx_M, torch.arange(M, device=idx_M.device))  # the zero row's readers all land on N
    return inv[:N]


def capacity_rows(m: ModelSpec, expert_TK: torch.Tensor):
    """(plan, slot_A, fill_R): the pooled-wave plan of capacity_plan, each assignment's row in the
    [E, C] expert buffers (E*C for a dropped one), and for each of the E*C rows the assignment that
    fills it (T*K, a zero row, for rows nobody fills)."""
    T, K = expert_TK.shape
    E = m.n_routed_experts
    plan = capacity_plan(expert_TK, E, m.ep_size, m.n_waves, m.capacity_factor_send, m.capacity_factor_recv)
    R = E * plan["c_recv"]
    slot_A = plan["slot_TK"].reshape(-1)
    return plan, slot_A, partial_inverse(slot_A, R)


class Block(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.attn = Attention(m)
        self.moe_norm = RMSNorm(m.d_model, m.norm_eps)
        self.moe = MoE(m)

    def forward(self, x_BSD, cos, sin, mask_SS):
        B, S, D = x_BSD.shape
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos, sin, mask_SS)
        y_TD, stats = self.moe(self.moe_norm(x_BSD).reshape(B * S, D), S)
        return x_BSD + y_TD.view(B, S, D), stats


class Embedding(nn.Module):
    def __init__(self, V: int, D: int):
        super().__init__()
        self.weight = _param(V, D)


class MoETransformer(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.m = m
        self.embed = Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.n_layers))
        self.final_norm = RMSNorm(m.d_model, m.norm_eps)
        self.lm_head = _param(m.d_model, m.vocab_size)

    def forward(self, tokens_BS: torch.Tensor):
        """Logits [B, S, V] (fp32) and per-layer MoE statistics stacked to [n_layers, ...]."""
        S = tokens_BS.shape[1]
        cos, sin = rope_tables(S, self.m.head_dim, self.m.rope_theta, tokens_BS.device)
        mask_SS = attention_mask(S, self.m.attention_window, tokens_BS.device)
        x_BSD = self.embed.weight[tokens_BS]
        stats = []
        for block in self.blocks:
            x_BSD, st = block(x_BSD, cos, sin, mask_SS)
            stats.append(st)
        logits_BSV = (self.final_norm(x_BSD) @ self.lm_head).float()
        return logits_BSV, {k: torch.stack([s[k] for s in stats]) for k in stats[0]}

    def load_numpy(self, arrays: dict[str, np.ndarray]) -> None:
        """Copy named float32 arrays (a checkpoint or init_params) into the model, shapes checked."""
        own = self.state_dict()
        missing = sorted(set(own) - set(arrays))
        if missing:
            raise ValueError(f"weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        with torch.no_grad():
            for k, t in own.items():
                a = arrays[k]
                if tuple(a.shape) != tuple(t.shape):
                    raise ValueError(f"{k} has shape {tuple(a.shape)}, the spec needs {tuple(t.shape)}")
                t.copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))

    def to_numpy(self) -> dict[str, np.ndarray]:
        return {k: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}


def loss_terms(model: MoETransformer, tokens_BS1: torch.Tensor, optim) -> tuple[torch.Tensor, dict]:
    """(total objective, metrics as 0-d tensors + per-layer expert loads)."""
    inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    logits_BSV, st = model(inputs_BS)
    lse_BS = torch.logsumexp(logits_BSV, -1)
    ce = (lse_BS - logits_BSV.gather(-1, targets_BS.unsqueeze(-1)).squeeze(-1)).mean()
    z = lse_BS.square().mean()
    return objective(ce, z, st, optim)


def objective(ce: torch.Tensor, z: torch.Tensor, st: dict, optim) -> tuple[torch.Tensor, dict]:
    """The training objective from the cross-entropy, the output z term and the per-layer router
    statistics `st` (stacked over layers), with its metrics as 0-d tensors (no host sync)."""
    aux, router_z = st["aux"].mean(), st["router_z"].mean()
    total = ce + optim.z_loss * z + optim.aux_loss * aux + optim.router_z_loss * router_z
    load_LE = st["load"]
    metrics = {
        "loss": ce.detach(),
        "z_loss": z.detach(),
        "aux_loss": aux.detach(),
        "router_z_loss": router_z.detach(),
        "drop_frac_send": st["drop_send"].mean(),
        "drop_frac_recv": st["drop_recv"].mean(),
        "expert_load_max": (load_LE.max(-1).values / load_LE.mean(-1)).max(),
        "router_entropy": st["entropy"].mean(),
        "total_loss": total.detach(),
    }
    return total, {"metrics": metrics, "load_LE": load_LE}
