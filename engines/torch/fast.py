"""The GPU fast path of the PyTorch engine: the model of engines/torch/model.py (same
parameters, same objective, same metrics) computed for throughput.

What changes against the reference forward (model.loss_terms under autocast), and why:
- dtypes are explicit rather than autocast's: weights are fp32 masters cast to the compute dtype
  (bf16 on CUDA) where a matmul reads them; the residual stream, norms' statistics, routing,
  router losses and the output log-partition stay fp32, as under autocast;
- attention reads one fused QKV projection and calls SDPA with is_causal and no mask when there
  is no sliding window (the flash / cuDNN kernels);
- dropless dispatch stays on the device: counts and group offsets by scatter-add (CUDA's
  bincount reads its maximum back to the host), one torch._grouped_mm per expert weight over
  the rows sorted by expert; dispatch and combine are row permutations whose backward is the
  inverse permutation (a gather: no atomics);
- capacity dispatch reuses model.capacity_plan (device-side) with fixed [E, C, L] buffers;
- every block and the output head go through torch.compile (regional: one compiled graph
  serves all blocks, so compiling costs one block, not the depth).

On the CPU the same code runs in fp32 with a loop over experts and no compilation; tests check
it against the reference forward there (tests/engines/test_torch_fast.py) and against the fp32
path on a GPU (tests/engines/test_gpu_bf16.py).

Shape legend as in model.py: B batch, S sequence, T tokens, D model, H heads, G kv heads, Q head
dim, V vocab, E routed experts, K top-k, L expert width, F expert hidden, A assignments (T*K).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.torch.model import MoETransformer, attention_mask, capacity_rows, group_counts, objective, rope_tables


@dataclass
class FastOptions:
    """Knobs of the fast path (the bench flips them to compare; the engine keeps the defaults)."""

    compile: str = "block"  # "block": blocks + head compiled; "dense": all but the expert
    # dispatch; "none": eager
    # SDPA kernels in order of preference ("cudnn": cuDNN, then flash, efficient, math); None:
    # SDPA's own order. cuDNN's causal attention ran 1.6x flash's forward + backward on an H200
    attn_backend: str | None = "cudnn"
    # weights as _grouped_mm reads them: "nmajor" [E, K, N] as stored, or "kmajor" (a transposed
    # copy); as stored ran 1.3x faster forward + backward on an H200 (bench/kernels_h200.py)
    grouped_mm_weights: str = "nmajor"


OPTIONS = FastOptions(compile=os.environ.get("MOE_LADDER_TORCH_COMPILE", "block"))


def fast_path_enabled(device: torch.device) -> bool:
    """The engine uses this path on CUDA; $MOE_LADDER_TORCH_FAST=0 turns it off."""
    return device.type == "cuda" and os.environ.get("MOE_LADDER_TORCH_FAST", "1") != "0"


def fused_clip_enabled(device: torch.device) -> bool:
    """$MOE_LADDER_TORCH_FUSED_CLIP=1 on CUDA: gradient clipping folded into the fused AdamW step
    (clip_scale + step_with_grad_scale) instead of clip_grad_norm_'s in-place pass over every
    gradient. Off by default: it has not yet been timed or checked on a GPU."""
    return device.type == "cuda" and os.environ.get("MOE_LADDER_TORCH_FUSED_CLIP", "0") == "1"


def clip_scale(params, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad norm, divisor) with grad / divisor == what clip_grad_norm_(params, max_norm) leaves,
    computed on the device without touching the gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return norm, 1.0 / torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def step_with_grad_scale(opt: torch.optim.Optimizer, grad_scale: torch.Tensor) -> None:
    """opt.step() on gradients divided by grad_scale. A fused Adam(W) divides inside its kernel
    (its AMP-unscale input), which saves a read and a write of every fp32 gradient; any other
    optimizer gets one foreach division first."""
    if all(g.get("fused") for g in opt.param_groups):
        opt.grad_scale = grad_scale.float()
        try:
            opt.step()
        finally:
            del opt.grad_scale
        return
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    torch._foreach_div_(grads, grad_scale)
    opt.step()


# ---- permutations with gather backwards ----------------------------------------------------------


class _Dispatch(torch.autograd.Function):
    """x_TL rows src_A (= token of each sorted assignment) -> x_AL; the backward gathers the
    gradient back to (token, slot) order with the inverse permutation and sums the K slots."""

    @staticmethod
    def forward(ctx, x_TL, src_A, inv_A, K: int):
        ctx.save_for_backward(inv_A)
        ctx.K = K
        return x_TL.index_select(0, src_A)

    @staticmethod
    def backward(ctx, g_AL):
        (inv_A,) = ctx.saved_tensors
        T = inv_A.shape[0] // ctx.K
        return g_AL.index_select(0, inv_A).view(T, ctx.K, -1).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """y = x[idx] for a permutation idx whose inverse is inv; backward g[inv]."""

    @staticmethod
    def forward(ctx, x, idx, inv):
        ctx.save_for_backward(inv)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g.index_select(0, inv), None, None


# ---- pieces --------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x_BHSQ: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor) -> torch.Tensor:
    half = x_BHSQ.shape[-1] // 2
    x1, x2 = x_BHSQ[..., :half], x_BHSQ[..., half:]
    cos, sin = cos_SP.to(x_BHSQ.dtype), sin_SP.to(x_BHSQ.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _sdpa(q, k, v, mask_SS, gqa: bool):
    if mask_SS is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_SS, enable_gqa=gqa)


def attention_residual(block, x_BSD, cos, sin, mask_SS, cdt: torch.dtype) -> torch.Tensor:
    """x + attn(attn_norm(x)), fp32 residual, matmuls in cdt."""
    a = block.attn
    B, S, _ = x_BSD.shape
    H, G, Q = a.H, a.G, a.Q
    h_BSD = _rms(x_BSD, block.attn_norm.weight, block.attn_norm.eps).to(cdt)
    w_qkv = torch.cat([a.wq, a.wk, a.wv], 1).to(cdt)
    qkv = h_BSD @ w_qkv
    q, k, v = qkv.split([H * Q, G * Q, G * Q], -1)
    q_BHSQ = _rope(q.view(B, S, H, Q).transpose(1, 2), cos, sin)
    k_BGSQ = _rope(k.view(B, S, G, Q).transpose(1, 2), cos, sin)
    v_BGSQ = v.view(B, S, G, Q).transpose(1, 2)
    o_BHSQ = _sdpa(q_BHSQ, k_BGSQ, v_BGSQ, mask_SS, G != H)
    return x_BSD + (o_BHSQ.transpose(1, 2).reshape(B, S, H * Q) @ a.wo.to(cdt)).float()


def _grouped_swiglu(x_AL, counts_E, experts, cdt: torch.dtype) -> torch.Tensor:
    """SwiGLU over rows sorted by expert (counts_E rows each), in cdt."""
    if x_AL.is_cuda and hasattr(torch, "_grouped_mm") and cdt == torch.bfloat16:
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        Fh = experts.w_gate.shape[-1]
        # gate and up as one [E, L, 2F] matmul: wider tiles, one dx GEMM in the backward
        w_gu = torch.cat([experts.w_gate, experts.w_up], -1).to(cdt)
        wd = experts.w_down.to(cdt)
        if OPTIONS.grouped_mm_weights == "kmajor":
            w_gu, wd = (w.transpose(-2, -1).contiguous().transpose(-2, -1) for w in (w_gu, wd))
        gu_A2F = torch._grouped_mm(x_AL, w_gu, offs=offs_E)
        h_AF = F.silu(gu_A2F[:, :Fh]) * gu_A2F[:, Fh:]
        return torch._grouped_mm(h_AF, wd, offs=offs_E)
    wg, wu, wd = (w.to(cdt) for w in (experts.w_gate, experts.w_up, experts.w_down))
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):  # CPU (or no grouped kernel): a host loop
        x = x_AL[start : start + n]
        outs.append((F.silu(x @ wg[e]) * (x @ wu[e])) @ wd[e])
        start += n
    return torch.cat(outs, 0)


def dropless_experts(moe, x_TL, expert_TK, cdt):
    """y_TKL: every assignment's expert output, in (token, slot) order."""
    T, K = expert_TK.shape
    e_A = expert_TK.reshape(-1)  # token-major: a = t * K + j
    order_A = torch.argsort(e_A, stable=True)
    inv_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(e_A.shape[0], device=e_A.device))
    counts_E = group_counts(e_A, moe.m.n_routed_experts)
    x_AL = _Dispatch.apply(x_TL.to(cdt), order_A // K, inv_A, K)
    y_sorted_AL = _grouped_swiglu(x_AL, counts_E, moe.experts, cdt)
    return _Permute.apply(y_sorted_AL, inv_A, order_A).view(T, K, -1)


def capacity_experts(moe, x_TL, expert_TK, cdt):
    """(y_TKL, send drops, receive drops) under the pooled-wave rules of model.capacity_plan."""
    m = moe.m
    T, K = expert_TK.shape
    E, L = m.n_routed_experts, x_TL.shape[-1]
    plan, slot_A, fill_R = capacity_rows(m, expert_TK)
    C = plan["c_recv"]
    src = torch.where(fill_R < T * K, fill_R // K, T)  # T: the zero row
    x_T1L = torch.cat([x_TL.to(cdt), x_TL.new_zeros(1, L, dtype=cdt)], 0)
    buf_ECL = x_T1L[src].view(E, C, L)
    ex = moe.experts
    if buf_ECL.is_cuda:  # gate and up as one [E, L, 2F] batched matmul
        Fh = ex.w_gate.shape[-1]
        gu_EC2F = torch.bmm(buf_ECL, torch.cat([ex.w_gate, ex.w_up], -1).to(cdt))
        h_ECF = F.silu(gu_EC2F[..., :Fh]) * gu_EC2F[..., Fh:]
    else:
        h_ECF = F.silu(torch.bmm(buf_ECL, ex.w_gate.to(cdt))) * torch.bmm(buf_ECL, ex.w_up.to(cdt))
    out_ECL = torch.bmm(h_ECF, ex.w_down.to(cdt))
    out_flat = torch.cat([out_ECL.reshape(E * C, L), out_ECL.new_zeros(1, L)], 0)
    y_TKL = out_flat[slot_A].view(T, K, L)
    return y_TKL, plan["send_drop_TK"].sum().float(), plan["recv_drop_TK"].sum().float()


def moe_route(block, x_BSD):
    """(h_TD fp32, expert_TK, gate_TK, router stats) of a block's MoE input."""
    B, S, D = x_BSD.shape
    h_TD = _rms(x_BSD, block.moe_norm.weight, block.moe_norm.eps).reshape(B * S, D)
    expert_TK, gate_TK, stats = block.moe.route(h_TD, S)
    return h_TD, expert_TK, gate_TK, stats


def moe_combine(block, x_BSD, h_TD, y_TKL, gate_TK, cdt):
    moe, m = block.moe, block.moe.m
    y_TL = (y_TKL.float() * gate_TK.unsqueeze(-1)).sum(1)
    y_TD = (y_TL.to(cdt) @ moe.latent_up.to(cdt)).float() if m.latent_dim is not None else y_TL
    if m.n_shared_experts > 0:
        sh, hc = moe.shared, h_TD.to(cdt)
        h_NTR = F.silu(torch.einsum("td,ndr->ntr", hc, sh.w_gate.to(cdt))) * torch.einsum(
            "td,ndr->ntr", hc, sh.w_up.to(cdt))
        y_TD = y_TD + torch.einsum("ntr,nrd->td", h_NTR, sh.w_down.to(cdt)).float()
    return x_BSD + y_TD.view(x_BSD.shape)


def moe_residual(block, x_BSD, cdt):
    """x + moe(moe_norm(x)) and the block's MoE statistics."""
    moe, m = block.moe, block.moe.m
    T, K = x_BSD.shape[0] * x_BSD.shape[1], m.top_k
    h_TD, expert_TK, gate_TK, stats = moe_route(block, x_BSD)
    x_TL = (h_TD.to(cdt) @ moe.latent_down.to(cdt)) if m.latent_dim is not None else h_TD
    if m.dispatch == "capacity":
        y_TKL, n_send, n_recv = capacity_experts(moe, x_TL, expert_TK, cdt)
    else:
        y_TKL = dropless_experts(moe, x_TL, expert_TK, cdt)
        n_send = n_recv = torch.zeros((), device=x_BSD.device)
    stats["drop_send"] = n_send / (T * K)
    stats["drop_recv"] = n_recv / (T * K)
    return moe_combine(block, x_BSD, h_TD, y_TKL, gate_TK, cdt), stats


def block_forward(block, x_BSD, cos, sin, mask_SS, cdt):
    x_BSD = attention_residual(block, x_BSD, cos, sin, mask_SS, cdt)
    return moe_residual(block, x_BSD, cdt)


def head_losses(x_BSD, final_norm, lm_head, targets_BS, cdt):
    """(mean CE, mean squared log-partition) of the output; logits never leave this function."""
    h = _rms(x_BSD, final_norm.weight, final_norm.eps).to(cdt)
    logits_BSV = (h @ lm_head.to(cdt)).float()
    lse_BS = torch.logsumexp(logits_BSV, -1)
    ce = (lse_BS - logits_BSV.gather(-1, targets_BS.unsqueeze(-1)).squeeze(-1)).mean()
    return ce, lse_BS.square().mean()


# ---- the loss ------------------------------------------------------------------------------------


class FastLoss:
    """loss(model, tokens_BS1, optim) with the contract of model.loss_terms."""

    def __init__(self, model: MoETransformer, device: torch.device, options: FastOptions | None = None):
        self.options = options or OPTIONS
        self.cdt = torch.bfloat16 if device.type == "cuda" else torch.float32
        mode = self.options.compile if device.type == "cuda" else "none"
        self._block, self._attn, self._moe_route, self._head = block_forward, None, None, head_losses
        if mode == "block":
            self._block = torch.compile(block_forward, dynamic=False)
            self._head = torch.compile(head_losses, dynamic=False)
        elif mode == "dense":
            self._attn = torch.compile(attention_residual, dynamic=False)
            self._moe_route = torch.compile(moe_route, dynamic=False)
            self._head = torch.compile(head_losses, dynamic=False)
        elif mode != "none":
            raise ValueError(f"unknown compile mode {mode!r} (block, dense or none)")
        self._tables: dict = {}

    def _run_block(self, block, x_BSD, cos, sin, mask_SS):
        if self._attn is None:
            return self._block(block, x_BSD, cos, sin, mask_SS, self.cdt)
        x_BSD = self._attn(block, x_BSD, cos, sin, mask_SS, self.cdt)
        moe, m = block.moe, block.moe.m
        T, K = x_BSD.shape[0] * x_BSD.shape[1], m.top_k
        h_TD, expert_TK, gate_TK, stats = self._moe_route(block, x_BSD)
        x_TL = (h_TD.to(self.cdt) @ moe.latent_down.to(self.cdt)) if m.latent_dim is not None else h_TD
        if m.dispatch == "capacity":
            y_TKL, n_send, n_recv = capacity_experts(moe, x_TL, expert_TK, self.cdt)
        else:
            y_TKL = dropless_experts(moe, x_TL, expert_TK, self.cdt)
            n_send = n_recv = torch.zeros((), device=x_BSD.device)
        stats["drop_send"] = n_send / (T * K)
        stats["drop_recv"] = n_recv / (T * K)
        return moe_combine(block, x_BSD, h_TD, y_TKL, gate_TK, self.cdt), stats

    def tables(self, S: int, m, device):
        key = (S, device)
        if key not in self._tables:
            cos, sin = rope_tables(S, m.head_dim, m.rope_theta, device)
            self._tables[key] = (cos, sin, attention_mask(S, m.attention_window, device))
        return self._tables[key]

    def __call__(self, model: MoETransformer, tokens_BS1: torch.Tensor, optim):
        inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
        S = inputs_BS.shape[1]
        cos, sin, mask_SS = self.tables(S, model.m, tokens_BS1.device)
        ctx = _sdpa_backend(self.options.attn_backend if tokens_BS1.is_cuda else None)
        with torch.autocast(tokens_BS1.device.type, enabled=False), ctx:
            x_BSD = model.embed.weight[inputs_BS]
            stats = []
            for block in model.blocks:
                x_BSD, st = self._run_block(block, x_BSD, cos, sin, mask_SS)
                stats.append(st)
            ce, z = self._head(x_BSD, model.final_norm, model.lm_head, targets_BS, self.cdt)
        st = {k: torch.stack([s[k] for s in stats]) for k in stats[0]}
        return objective(ce, z, st, optim)


def _sdpa_backend(name: str | None):
    import contextlib

    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = order.pop(name)
    return sdpa_kernel([first, *order.values()], set_priority=True)
