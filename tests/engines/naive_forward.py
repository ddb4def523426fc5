"""A naive forward of the torch model's parameters, for tests: every token's attention and
experts written out with plain ops (dense masks, repeated kv heads, a loop over each token's
chosen experts), no dispatcher, kernel or working copy of the engine. The routing decisions and
their statistics come from the model's MoE.route, the losses from engines/torch/loss.py. It knows
nothing of capacity dispatch: a run with room for every assignment equals dropless.

Shape legend as in engines/torch/model.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engines.torch.loss import head_losses
from engines.torch.model import MoETransformer, attention_mask, objective, rope_tables


def _rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _rope(x_BHSQ, cos_SP, sin_SP):
    half = x_BHSQ.shape[-1] // 2
    x1, x2 = x_BHSQ[..., :half], x_BHSQ[..., half:]
    return torch.cat([x1 * cos_SP - x2 * sin_SP, x2 * cos_SP + x1 * sin_SP], -1)


def _swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


def attention(blk, x_BSD, cos, sin, allowed_SS):
    a = blk.attn
    B, S, _ = x_BSD.shape
    q = _rope((x_BSD @ a.wq).view(B, S, a.H, a.Q).transpose(1, 2), cos, sin)
    k = _rope((x_BSD @ a.wk).view(B, S, a.G, a.Q).transpose(1, 2), cos, sin)
    v = (x_BSD @ a.wv).view(B, S, a.G, a.Q).transpose(1, 2)
    k, v = k.repeat_interleave(a.H // a.G, 1), v.repeat_interleave(a.H // a.G, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.Q)
    o = torch.softmax(scores.masked_fill(~allowed_SS, float("-inf")), -1) @ v
    return o.transpose(1, 2).reshape(B, S, a.H * a.Q) @ a.wo


def moe(blk, h_TD, seq_len):
    mo, m = blk.moe, blk.moe.m
    expert_TK, gate_TK, stats = mo.route(h_TD, seq_len)
    x_TL = h_TD @ mo.latent_down if m.latent_dim is not None else h_TD
    ex = mo.experts
    rows = []
    for t in range(x_TL.shape[0]):
        y = sum(gate_TK[t, j] * _swiglu(x_TL[t], ex.w_gate[e], ex.w_up[e], ex.w_down[e])
                for j, e in enumerate(expert_TK[t].tolist()))
        rows.append(y)
    y_TD = torch.stack(rows)
    if m.latent_dim is not None:
        y_TD = y_TD @ mo.latent_up
    if m.n_shared_experts > 0:
        sh = mo.shared
        y_TD = y_TD + sum(_swiglu(h_TD, sh.w_gate[n], sh.w_up[n], sh.w_down[n]) for n in range(m.n_shared_experts))
    T, K = expert_TK.shape
    zero = torch.zeros(())
    stats.update(drop_send=zero, drop_recv=zero, n_send=zero, n_recv=zero)
    return y_TD, stats


def naive_loss(model: MoETransformer, tokens_BS1: torch.Tensor, optim):
    """(total objective, {"metrics", "load_LE"}) as engines/torch/forward.Forward returns them."""
    m = model.m
    inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    B, S = inputs_BS.shape
    cos, sin = rope_tables(S, m.head_dim, m.rope_theta, "cpu")
    window = attention_mask(S, m.attention_window, "cpu")
    allowed_SS = torch.ones(S, S).tril().bool() if window is None else window
    x = model.embed.weight[inputs_BS]
    stats = []
    for blk in model.blocks:
        x = x + attention(blk, _rms(x, blk.attn_norm), cos, sin, allowed_SS)
        y_TD, st = moe(blk, _rms(x, blk.moe_norm).reshape(B * S, -1), S)
        x = x + y_TD.view(B, S, -1)
        stats.append(st)
    ce, z = head_losses(_rms(x, model.final_norm) @ model.lm_head, targets_BS)
    return objective(ce, z, {k: torch.stack([s[k] for s in stats]) for k in stats[0]}, optim)
