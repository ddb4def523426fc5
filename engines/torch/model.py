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

One module tree and one forward serve every torch path (engines/torch/forward.py computes it,
its kernels chosen when it is built; the reference is a kernel choice). What differs between the
paths is (a) the token dispatcher the Experts module holds (engines/torch/dispatch.py: Dropless or
Capacity on one device, the model.dispatch of the spec; engines/torch/parallel/dispatch.py swaps
in its cross-process ones) and (b) the kernels (EngineOptions.torch_fast and torch_kernels
choose). An assignment's output is combined in (token, slot) order, so capacity with no drops
equals dropless. Routing metadata stays on the device: no host sync inside the forward pass
except the CPU expert loop.

Sharded objective (expert parallel, engines/torch/parallel/): each rank's backward
seeds its share of the global objective, sum over the ranks = the one-device objective: CE,
output z-loss and router z-loss are local means / world; the batch-scope balancing loss
E * sum_e f_e p_e is linear in p, so a rank contributes E * sum_e f_e * (sum of its tokens' p_e) / T
with f_e from the loads summed over ranks (one all-reduce after the forward); sequence scope is
per sequence, so local mean / world.

Shape legend: B batch, S sequence, T tokens (B*S), D model, H heads, G kv heads, Q head dim,
V vocab, E routed experts, K top-k, L expert width (latent or D), F expert hidden, N shared
experts, R shared hidden, A assignments (T*K), C receiver rows per expert.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from core.spec import ModelSpec
from engines.params import init_arrays, tensor_shapes
from engines.torch.dispatch import local_dispatcher

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



# ---- routed experts -------------------------------------------------------------------------------


class Experts(nn.Module):
    """The routed experts this process holds (SwiGLU stacks [E, L, F], [E, F, L]) and the token
    dispatcher that brings them their rows (engines/torch/dispatch.py; expert parallel swaps it).
    Its forward is the whole dispatch, so a wrapper hooking the module (FSDP2) holds the expert
    weights for exactly that long."""

    def __init__(self, E: int, L: int, Fh: int, dispatcher):
        super().__init__()
        self.w_gate = _param(E, L, Fh)
        self.w_up = _param(E, L, Fh)
        self.w_down = _param(E, Fh, L)
        self.dispatcher = dispatcher

    def forward(self, x_TL: torch.Tensor, expert_TK: torch.Tensor, gate_TK: torch.Tensor, kernels):
        """(y_TKL or y_TL, send drops, receive drops) with the kernels kernels(self) makes
        (engines/torch/experts.CastKernels over these weights, cast while the call lasts)."""
        return self.dispatcher(kernels(self), x_TL, expert_TK, gate_TK)

class SharedExperts(nn.Module):
    def __init__(self, N: int, D: int, R: int):
        super().__init__()
        self.w_gate = _param(N, D, R)
        self.w_up = _param(N, D, R)
        self.w_down = _param(N, R, D)



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
        self.experts = Experts(E, m.expert_dim, m.expert_hidden, local_dispatcher(m))
        if m.n_shared_experts > 0:
            self.shared = SharedExperts(m.n_shared_experts, m.d_model, m.shared_hidden)

    def route(self, x_TD: torch.Tensor, seq_len: int, logits_TE: torch.Tensor | None = None, topk=None):
        """(expert_TK, gate_TK, stats); logits_TE: the router logits if the caller computed them;
        topk(select_TE, K) -> expert_TK: the selection (default torch.topk's indices)."""
        m = self.m
        T, E, K = x_TD.shape[0], m.n_routed_experts, m.top_k
        if logits_TE is None:
            with torch.autocast(x_TD.device.type, enabled=False):  # routing decisions in fp32
                logits_TE = x_TD.float() @ self.router.float()
        scores_TE = torch.softmax(logits_TE, -1) if m.router_kind == "softmax" else torch.sigmoid(logits_TE)
        select_TE = scores_TE + self.router_bias if m.router_bias_balancing else scores_TE
        if topk is None:
            expert_TK = torch.topk(select_TE.detach(), K, dim=-1).indices
        else:
            expert_TK = topk(select_TE.detach(), K)
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
        if m.balance_scope == "batch":  # a sharded objective's balancing loss sums p over every rank's tokens
            stats["probs_sum"] = probs_TE.sum(0)
        return expert_TK, gate_TK, stats

class Block(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps)
        self.attn = Attention(m)
        self.moe_norm = RMSNorm(m.d_model, m.norm_eps)
        self.moe = MoE(m)

    def forward(self, x_BSD, cos, sin, mask_SS, run):
        """The block's computation as its module call, run(self, None, x_BSD, cos, sin, mask_SS)
        (engines/torch/forward.Forward hands it in), which a wrapper (FSDP2) hooks: it holds the
        block's gathered parameters for exactly as long as the block runs."""
        return run(self, None, x_BSD, cos, sin, mask_SS)


class Embedding(nn.Module):
    def __init__(self, V: int, D: int):
        super().__init__()
        self.weight = _param(V, D)


class MoETransformer(nn.Module):
    """The parameters of the spec's model; engines/torch/forward.Forward computes it."""

    def __init__(self, m: ModelSpec):
        super().__init__()
        self.m = m
        self.embed = Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.n_layers))
        self.final_norm = RMSNorm(m.d_model, m.norm_eps)
        self.lm_head = _param(m.d_model, m.vocab_size)

    def forward(self, tokens_BS: torch.Tensor, *args, run):
        """run(self, tokens_BS, *args): a forward of this module tree (engines/torch/forward.Forward,
        or a layout's sharded objective) as this module's call, which a wrapper hooking the model
        (FSDP2's root unit) sees as its forward."""
        return run(self, tokens_BS, *args)

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


@torch.no_grad()
def move_router_bias(model: MoETransformer, load_LE: torch.Tensor, rate: float,
                     finite: torch.Tensor | None = None) -> None:
    """The balancing bias's step (model.router_bias_balancing): each layer's bias moves by `rate`
    towards its under-loaded experts (sign of mean load - load, from the step's global loads
    load_LE); with `finite` (a 0-d bool on the device) a non-finite step moves nothing."""
    upd_LE = rate * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)
    if finite is not None:
        upd_LE = torch.where(finite, upd_LE, 0.0)  # (a NaN load would survive a multiply by 0)
    for i, blk in enumerate(model.blocks):
        blk.moe.router_bias.add_(upd_LE[i])


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


FORWARD_KEYS = ("loss", "z_loss", "router_z_loss", "router_entropy", "drop_send", "drop_recv")


def sharded_objective(ce: torch.Tensor, z: torch.Tensor, st: dict, optim, m: ModelSpec, n_tokens: int,
                      world: int, all_reduce) -> tuple[torch.Tensor, dict]:
    """This rank's share of the step objective (the module docstring's sharded objective) from its
    local CE, output z term and per-layer statistics `st` (stacked over layers, with the raw drop
    counts n_send / n_recv and, for batch-scope balancing, probs_sum), and the step's global
    forward metrics. n_tokens: tokens of the whole step; all_reduce(t): t summed over the ranks.
    Returns (total_r, {"global": forward metrics summed over the ranks, "aux_r", "total_r",
    "load_LE": the global expert loads})."""
    n_layers, K, E = st["load"].shape[0], m.top_k, m.n_routed_experts
    router_z = st["router_z"].mean()
    # one all-reduce of everything the forward measured: global loads set the balancing loss
    fwd = torch.cat([
        torch.stack([ce.detach() / world, z.detach() / world, router_z.detach() / world,
                     st["entropy"].mean().detach() / world,
                     st["n_send"].sum() / (n_tokens * K * n_layers),
                     st["n_recv"].sum() / (n_tokens * K * n_layers)]).float(),
        st["load"].float().reshape(-1)])
    fwd = all_reduce(fwd)
    g = dict(zip(FORWARD_KEYS, fwd[: len(FORWARD_KEYS)]))
    load_LE = fwd[len(FORWARD_KEYS):].view(n_layers, E)
    if m.balance_scope == "batch":
        f_LE = load_LE / (n_tokens * K)
        aux_r = (E * (f_LE * st["probs_sum"]).sum(-1) / n_tokens).mean()
    else:
        aux_r = st["aux"].mean() / world
    total_r = (ce + optim.z_loss * z + optim.router_z_loss * router_z) / world + optim.aux_loss * aux_r
    return total_r, {"global": g, "aux_r": aux_r.detach(), "total_r": total_r.detach(), "load_LE": load_LE}
