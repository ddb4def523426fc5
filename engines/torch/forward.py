"""The forward of the PyTorch engine's model (engines/torch/model.py holds its parameters): one
computation, with its kernels chosen when it is built (options.torch_kernels; Forward).

How it computes:
- dtypes are explicit: the matmuls run in a compute dtype (bf16 on a GPU, fp32 on the CPU, or the
  dtype asked for), reading bf16 working copies of the fp32 masters written by the optimizer
  (engines/torch/master.py) or casts of the masters made every step; the residual stream, norms'
  statistics, routing, router losses and the output log-partition stay fp32;
- attention reads one fused QKV projection and calls SDPA with is_causal and no mask when there
  is no sliding window (the flash / cuDNN kernels); a sliding window runs through FlexAttention
  with a block mask on a GPU (kernels window_attention="flex": the blocks wholly outside the
  window are skipped) or SDPA with a dense [S, S] mask ("mask");
- the routed experts go through the block's token dispatcher (engines/torch/dispatch.py, or an
  expert-parallel one) with the kernels of engines/torch/experts.CastKernels: dropless dispatch
  stays on the device (counts and group offsets by scatter-add, one grouped GEMM per expert
  weight over the rows sorted by expert); dispatch and combine are row permutations whose
  backward is the inverse permutation (a gather: no atomics); the combine's and the dispatch
  backward's gather-and-sum run as Triton kernels (kernels gather="inductor" leaves them to
  torch); the expert matmuls' weight gradients run as one Triton kernel each (grouped_dw="torch"
  leaves them to _grouped_mm); capacity dispatch fills fixed [E, C, L] buffers by the device-side
  pooled-wave plan;
- every block and the output head go through torch.compile on a GPU (regional: one compiled graph
  serves all blocks, so compiling costs one block, not the depth).

The reference is a kernel choice, not another forward: TorchKernels.reference() (options
torch_fast=0) is plain torch everywhere (eager, fp32 router and torch.topk, SDPA's own backend,
no Triton). On the CPU every choice runs as torch ops in fp32 and no block is compiled; tests
check the kernel choices against each other there (tests/engines/test_torch_forward.py) and the
bf16 forward against the fp32 one on a GPU (tests/engines/test_gpu_bf16.py).

Shape legend: B batch, S sequence, T tokens, D model, H heads, G kv heads, Q head dim, V vocab,
E routed experts, K top-k, L expert width, F expert hidden, A assignments (T*K).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from core.costs import flops_per_token
from core.spec import Spec
from engines.options import EngineOptions, TorchKernels
from engines.torch.kernels import adamw_kernel, xent
from engines.torch.experts import CastKernels, kernels_here
from engines.torch.model import MoETransformer, attention_mask, objective, rope_tables
from engines.torch.kernels.tf32 import mm_tf32
from engines.torch.kernels.topk import topk_indices
from engines.torch.loss import head_losses, token_losses


def fast_path_enabled(device: torch.device, options: EngineOptions) -> bool:
    """Whether the GPU kernels run: on CUDA unless options.torch_fast is off (torch_fast=0: the
    reference kernels, TorchKernels.reference())."""
    return device.type == "cuda" and options.torch_fast


def kernels_for(device: torch.device, options: EngineOptions) -> TorchKernels:
    """The kernels the forward runs with here: options.torch_kernels as they can run here, or the
    reference ones where options.torch_fast is off."""
    if device.type == "cuda" and not options.torch_fast:
        return TorchKernels.reference()
    return kernels_here(options.torch_kernels)


# MasterAdamW's compiled update (kernels adamw "compile", or no Triton) costs up to about a
# minute of warm-up (H200, bench shape, cold compile cache) for 2-3.5% faster steps: it repays that
# after about 30-40 minutes of steps. Its Triton kernel (the default) compiles nothing.
WORKING_COPIES_MIN_SECONDS = 2400.0
ASSUMED_MFU = 0.3  # what the GPU kernels measured at the H200 bench shape (33%)


def working_copies_enabled(device: torch.device, options: EngineOptions, expected_seconds: float | None = None) -> bool:
    """Whether the GPU kernels' forward keeps bf16 working copies written by the optimizer
    (engines/torch/master.py). options.torch_master True / False (torch_master=1 / 0)
    forces it on / off; otherwise on with MasterAdamW's Triton kernel (its default where Triton
    is installed), or when the run is expected to last at least WORKING_COPIES_MIN_SECONDS
    (expected_seconds None: unknown, on). Off, the matmuls cast the fp32 masters every step (no
    extra compile)."""
    if not fast_path_enabled(device, options):
        return False
    if options.torch_master is not None:
        return options.torch_master
    if kernels_here(options.torch_kernels).adamw == "triton" and adamw_kernel.triton is not None:
        return True  # MasterAdamW's own kernel: nothing to compile, so no warm-up to repay
    return expected_seconds is None or expected_seconds >= WORKING_COPIES_MIN_SECONDS


def working_dtype(spec: Spec, device: torch.device, options: EngineOptions) -> torch.dtype | None:
    """The dtype of the working copies the step's forward reads (MasterAdamW writes them:
    engines/torch/master.build_optimizer), or None: the forward reads the fp32 masters (casting
    them where it computes in 16 bits). bf16 on CUDA with the GPU kernels where working_copies_enabled,
    from the run's expected duration at the spec's hardware (each of its GPUs does its share; each
    pays the compile). A spec with bf16 moments always has them (only MasterAdamW stores moments
    off the parameters' dtype): bf16, or fp32 copies on the CPU."""
    if spec.optim.moments == "bf16":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    flops = float(flops_per_token(spec, spec.data.seq_len)) * spec.data.total_tokens
    hw = spec.hardware
    rate = ASSUMED_MFU * hw.peak_flops * max(hw.n_gpus, 1)
    expected_s = flops / rate if flops > 0 and rate > 0 else None
    return torch.bfloat16 if working_copies_enabled(device, options, expected_s) else None


# ---- pieces --------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., Q] (its sequence dim where cos and sin [S, Q/2] broadcast: x
    [B, H, S, Q] reads them as they are, x [B, S, H, Q] as [S, 1, Q/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# FlexAttention runs as a generated kernel only compiled; inside a compiled block Dynamo traces
# straight into it, outside (compile "none") this compiled wrapper is the kernel
@functools.cache
def _flex_compiled():
    """FlexAttention compiled, made on first use on a GPU (torch.compile imports TorchDynamo, which
    a CPU process never needs)."""
    return torch.compile(flex_attention, dynamic=False)


FLEX_MIN_HEAD_DIM = 16  # the smallest head dim FlexAttention's compiled kernel takes (torch 2.11)


def window_block_mask(seq_len: int, window: int | None, device) -> BlockMask:
    """FlexAttention's block mask of causal attention within the last `window` positions (None:
    plain causal); the mask of model.attention_mask, as blocks: those wholly outside it are skipped."""

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    mask_mod = causal if window is None or window >= seq_len else causal_window
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)


def _sdpa(q, k, v, mask_SS, gqa: bool):
    """Causal attention of q [B, H, S, Q] over k, v [B, G, S, Q]: SDPA with is_causal (mask_SS
    None), FlexAttention (a BlockMask) or SDPA with a dense [S, S] bool mask."""
    if isinstance(mask_SS, BlockMask):
        flex = _flex_compiled() if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask_SS, enable_gqa=gqa)
    if mask_SS is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_SS, enable_gqa=gqa)


def expert_weights(experts, cdt: torch.dtype) -> dict[str, torch.Tensor]:
    """The routed experts' matmul weights in cdt (gate|up concatenated along the last dim)."""
    return {"moe.experts.gate_up": torch.cat([experts.w_gate, experts.w_up], -1).to(cdt),
            "moe.experts.w_down": experts.w_down.to(cdt)}


def expert_kernels(experts, cdt: torch.dtype, o: TorchKernels) -> CastKernels:
    """The fast kernels over an Experts module's own weights, cast when it runs (a hooked module:
    FSDP2 has gathered them for exactly that long)."""
    return CastKernels(experts, expert_weights(experts, cdt), cdt, o)


def block_weights(block, cdt: torch.dtype, experts: bool = True) -> dict[str, torch.Tensor]:
    """A block's matmul weights in cdt, cast from the fp32 masters, under the names and layouts of
    master.weight_layout (q|k|v and gate|up concatenated along the last dim); experts False leaves
    the routed experts' out (their module casts them when it runs: expert_kernels)."""
    a = block.attn
    return {"attn.qkv": torch.cat([a.wq, a.wk, a.wv], -1).to(cdt), "attn.wo": a.wo.to(cdt),
            **moe_weights(block.moe, cdt, experts)}


def moe_weights(moe, cdt: torch.dtype, experts: bool = True) -> dict[str, torch.Tensor]:
    """An MoE module's share of block_weights (keys "moe.*")."""
    w = expert_weights(moe.experts, cdt) if experts else {}
    if moe.m.latent_dim is not None:
        w["moe.latent_down"], w["moe.latent_up"] = moe.latent_down.to(cdt), moe.latent_up.to(cdt)
    if moe.m.n_shared_experts > 0:
        w["moe.shared.gate_up"] = torch.cat([moe.shared.w_gate, moe.shared.w_up], -1).to(cdt)
        w["moe.shared.w_down"] = moe.shared.w_down.to(cdt)
    return w


def attention_residual(block, w, x_BSD, cos, sin, mask_SS, cdt: torch.dtype, o: TorchKernels) -> torch.Tensor:
    """x + attn(attn_norm(x)), fp32 residual, matmuls in cdt (w: block_weights or working copies)."""
    a = block.attn
    B, S, _ = x_BSD.shape
    H, G, Q = a.H, a.G, a.Q
    h_BSD = _rms(x_BSD, block.attn_norm.weight, block.attn_norm.eps).to(cdt)
    qkv = h_BSD @ w["attn.qkv"]
    q, k, v = qkv.split([H * Q, G * Q, G * Q], -1)
    if o.rope_layout == "bshq":
        q_BHSQ = _rope(q.view(B, S, H, Q), cos[:, None], sin[:, None]).transpose(1, 2)
        k_BGSQ = _rope(k.view(B, S, G, Q), cos[:, None], sin[:, None]).transpose(1, 2)
    else:
        q_BHSQ = _rope(q.view(B, S, H, Q).transpose(1, 2), cos, sin)
        k_BGSQ = _rope(k.view(B, S, G, Q).transpose(1, 2), cos, sin)
    v_BGSQ = v.view(B, S, G, Q).transpose(1, 2)
    o_BHSQ = _sdpa(q_BHSQ, k_BGSQ, v_BGSQ, mask_SS, G != H)
    return x_BSD + (o_BHSQ.transpose(1, 2).reshape(B, S, H * Q) @ w["attn.wo"]).float()


def moe_route(block, x_BSD, o: TorchKernels):
    """(h_TD fp32, expert_TK, gate_TK, router stats) of a block's MoE input."""
    B, S, D = x_BSD.shape
    h_TD = _rms(x_BSD, block.moe_norm.weight, block.moe_norm.eps).reshape(B * S, D)
    logits_TE = None
    if o.router == "tf32":  # (on the CPU an fp32 matmul through the same op)
        logits_TE = mm_tf32(h_TD, block.moe.router.float())  # (a bf16 gather under FSDP2's mixed precision)
    topk = topk_indices if o.topk == "triton" else None
    expert_TK, gate_TK, stats = block.moe.route(h_TD, S, logits_TE, topk)
    return h_TD, expert_TK, gate_TK, stats


def moe_combine(moe, w, x_BSD, h_TD, y, gate_TK, cdt):
    """x + the MoE output; y: y_TKL (each assignment's output, summed with the gates here) or
    y_TL (already summed)."""
    m = moe.m
    y_TL = (y.float() * gate_TK.unsqueeze(-1)).sum(1) if y.dim() == 3 else y
    y_TD = (y_TL.to(cdt) @ w["moe.latent_up"]).float() if m.latent_dim is not None else y_TL
    if m.n_shared_experts > 0:
        hc, R = h_TD.to(cdt), w["moe.shared.w_down"].shape[1]
        gu_NTR2 = torch.einsum("td,ndr->ntr", hc, w["moe.shared.gate_up"])
        h_NTR = F.silu(gu_NTR2[..., :R]) * gu_NTR2[..., R:]
        y_TD = y_TD + torch.einsum("ntr,nrd->td", h_NTR, w["moe.shared.w_down"]).float()
    return x_BSD + y_TD.view(x_BSD.shape)


def moe_experts(moe, w, h_TD, expert_TK, gate_TK, cdt, o: TorchKernels):
    """(y_TKL or y_TL, send drops, receive drops) of an MoE module's routed experts: its
    dispatcher (engines/torch/dispatch.py, or an expert-parallel one) with the kernels of o; with
    no expert weights in w (block_weights experts=False), through the Experts module's call."""
    m = moe.m
    x_TL = (h_TD.to(cdt) @ w["moe.latent_down"]) if m.latent_dim is not None else h_TD
    if "moe.experts.gate_up" not in w:
        return moe.experts(x_TL, expert_TK, gate_TK, kernels=functools.partial(expert_kernels, cdt=cdt, o=o))
    return moe.experts.dispatcher(CastKernels(moe.experts, w, cdt, o), x_TL, expert_TK, gate_TK)


def moe_residual(block, w, x_BSD, cdt, o: TorchKernels, route=None):
    """x + moe(moe_norm(x)) and the block's MoE statistics (route: moe_route or its compiled form)."""
    T, K = x_BSD.shape[0] * x_BSD.shape[1], block.moe.m.top_k
    h_TD, expert_TK, gate_TK, stats = (route or moe_route)(block, x_BSD, o)
    y, n_send, n_recv = moe_experts(block.moe, w, h_TD, expert_TK, gate_TK, cdt, o)
    stats["drop_send"] = n_send / (T * K)
    stats["drop_recv"] = n_recv / (T * K)
    stats["n_send"], stats["n_recv"] = n_send, n_recv
    return moe_combine(block.moe, w, x_BSD, h_TD, y, gate_TK, cdt), stats


def block_forward(block, w, x_BSD, cos, sin, mask_SS, cdt, o: TorchKernels):
    """One block; w: its working copies, or None to cast the fp32 masters here."""
    if w is None:
        w = block_weights(block, cdt)
    x_BSD = attention_residual(block, w, x_BSD, cos, sin, mask_SS, cdt, o)
    return moe_residual(block, w, x_BSD, cdt, o)


def head_logits(x_BSD, final_norm, lm_head, cdt):
    """The output logits [B, S, V] in cdt (lm_head: the fp32 master or its working copy)."""
    return _rms(x_BSD, final_norm.weight, final_norm.eps).to(cdt) @ lm_head.to(cdt)


def output_losses(x_BSD, final_norm, lm_head, targets_BS, cdt, o: TorchKernels):
    """(mean CE, mean squared log-partition) of the output (engines/torch/loss.head_losses, by the
    Triton kernels where o.xent says so and they run); logits never leave this function."""
    logits_BSV = head_logits(x_BSD, final_norm, lm_head, cdt)
    if o.xent == "triton" and xent.kernels_usable(logits_BSV):
        return head_losses(logits_BSV.flatten(0, 1), targets_BS.flatten(), kernel=True)
    return head_losses(logits_BSV, targets_BS)


# ---- the forward ---------------------------------------------------------------------------------


class Forward:
    """The model's forward with its kernels: forward(model, tokens_BS1) -> (CE, z, per-layer
    statistics); called as loss(model, tokens_BS1, optim) -> model.objective's (total, metrics).

    kernels: the kernel choices (default: TorchKernels() as they can run here). working: the
    step's MasterAdamW where it keeps 16-bit working copies (the matmuls read them and their
    gradients land there; the fp32 masters of those matrices get none); without it the matmuls
    cast the masters every step. cdt: the matmuls' dtype without working copies (bf16 on CUDA,
    fp32 elsewhere). compile: the compile mode (kernels.compile on CUDA, none elsewhere).
    hooked: a wrapper (FSDP2) hooks the blocks, so each block runs as its module call (Block.forward
    hands the computation back here) and reads its weights inside it; hooked_experts: the Experts
    modules are hooked too (their weights read inside their own call; default: as hooked)."""

    def __init__(self, device: torch.device, kernels: TorchKernels | None = None, working=None,
                 cdt: torch.dtype | None = None, compile: str | None = None, hooked: bool = False,
                 hooked_experts: bool | None = None):
        self.options = kernels or kernels_here(TorchKernels())
        self.modules = hooked
        self.hooked_experts = hooked if hooked_experts is None else hooked_experts
        self.working = working
        self.cdt = working.dtype if working is not None else (
            cdt or (torch.bfloat16 if device.type == "cuda" else torch.float32))
        mode = compile or (self.options.compile if device.type == "cuda" else "none")
        self._block, self._attn, self._moe_route, self._head = block_forward, None, None, output_losses
        self._cudagraphs = mode == "block-cudagraphs"
        if mode in ("block", "block-cudagraphs"):
            # CUDA graphs replay the step's ~1,500 kernels without kernel-to-kernel launch gaps;
            # the working copies keep their addresses, so they are marked static (not copied in)
            kw = {"mode": "reduce-overhead"} if self._cudagraphs else {}
            if self._cudagraphs and working is not None:
                for leaf in working.working().values():
                    torch._dynamo.mark_static_address(leaf)
            self._block = torch.compile(block_forward, dynamic=False, **kw)
            self._head = torch.compile(output_losses, dynamic=False, **kw)
        elif mode == "dense":  # all but the expert dispatch (collectives, host sizes stay eager)
            self._attn = torch.compile(attention_residual, dynamic=False)
            self._moe_route = torch.compile(moe_route, dynamic=False)
            self._head = torch.compile(output_losses, dynamic=False)
        elif mode != "none":
            raise ValueError(f"unknown compile mode {mode!r} (block, block-cudagraphs, dense or none)")
        self._tables: dict = {}
        self._per_block: list[dict] | None = None

    def _weights(self, model: MoETransformer):
        """(per-block weight dicts or Nones, the lm head in cdt or its fp32 master)."""
        if self.working is None:
            return [None] * len(model.blocks), model.lm_head
        leaves = self.working.working()  # the same tensors every step, refreshed in place
        if self._per_block is None:
            self._per_block = [{} for _ in model.blocks]
            for name, t in leaves.items():
                if name.startswith("blocks."):
                    _, i, key = name.split(".", 2)
                    self._per_block[int(i)][key] = t
        return self._per_block, leaves["lm_head"]

    def _run_block(self, block, w, x_BSD, cos, sin, mask_SS):
        if self.modules:  # the module call: Block.forward runs _compute_block inside the hooks
            return block(x_BSD, cos, sin, mask_SS, run=self._compute_block)
        return self._compute_block(block, w, x_BSD, cos, sin, mask_SS)

    def _compute_block(self, block, w, x_BSD, cos, sin, mask_SS):
        if self.modules:  # the block's weights read inside its (hooked) call, the experts' in theirs
            w = block_weights(block, self.cdt, experts=False) if self.hooked_experts else None
        if self._attn is None:
            return self._block(block, w, x_BSD, cos, sin, mask_SS, self.cdt, self.options)
        w = w if w is not None else block_weights(block, self.cdt)
        x_BSD = self._attn(block, w, x_BSD, cos, sin, mask_SS, self.cdt, self.options)
        return moe_residual(block, w, x_BSD, self.cdt, self.options, route=self._moe_route)

    def tables(self, S: int, m, device):
        key = (S, device)
        if key not in self._tables:
            cos, sin = rope_tables(S, m.head_dim, m.rope_theta, device)
            window = m.attention_window
            windowed = window is not None and window < S
            kind = self.options.window_attention if windowed else self.options.causal_attention
            # FlexAttention's compiled kernel needs a head dim of 16 or more (Inductor refuses
            # less: "NYI: embedding dimension ... must be at least 16"); below that, the dense mask
            if kind == "flex" and torch.device(device).type == "cuda" and m.head_dim >= FLEX_MIN_HEAD_DIM:
                mask = window_block_mask(S, window, device)
                if self._cudagraphs:  # the same mask every step: replays read it in place
                    for t in mask.as_tuple():
                        if isinstance(t, torch.Tensor):
                            torch._dynamo.mark_static_address(t)
            else:
                mask = attention_mask(S, window, device)
            self._tables[key] = (cos, sin, mask)
        return self._tables[key]

    def embed(self, model: MoETransformer, inputs_BS: torch.Tensor) -> torch.Tensor:
        if self.modules:  # (indexing, as the expert-parallel ranks always did)
            return model.embed.weight[inputs_BS]
        # F.embedding: its backward is a sorted segment sum; indexing's (index_put with
        # accumulate) took 3.4 ms of a 119 ms H200 step
        return F.embedding(inputs_BS, model.embed.weight)

    def _trunk(self, model: MoETransformer, inputs_BS: torch.Tensor):
        """(the last block's output, per-layer statistics, the lm head as the head reads it);
        autocast off and the SDPA backend chosen around the caller's block."""
        S = inputs_BS.shape[1]
        cos, sin, mask_SS = self.tables(S, model.m, inputs_BS.device)
        per_block, lm_head = self._weights(model)
        if self._cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are done with
        x_BSD = self.embed(model, inputs_BS)
        stats = []
        for block, w in zip(model.blocks, per_block):
            x_BSD, st = self._run_block(block, w, x_BSD, cos, sin, mask_SS)
            stats.append(st)
        return x_BSD, stats, lm_head

    def _context(self, tokens: torch.Tensor):
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.autocast(tokens.device.type, enabled=False))
        ctx.enter_context(sdpa_backend(self.options.attn_backend if tokens.is_cuda else None))
        return ctx

    def forward(self, model: MoETransformer, tokens_BS1: torch.Tensor):
        """(mean CE, mean squared log-partition, per-layer statistics stacked over layers)."""
        inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
        with self._context(tokens_BS1):
            x_BSD, stats, lm_head = self._trunk(model, inputs_BS)
            ce, z = self._head(x_BSD, model.final_norm, lm_head, targets_BS, self.cdt, self.options)
        return ce, z, {k: torch.stack([s[k] for s in stats]) for k in stats[0]}

    @torch.no_grad()
    def row_ce(self, model: MoETransformer, tokens_BS1: torch.Tensor, rows: int = 8) -> torch.Tensor:
        """Each row's mean CE (fp32, [B]), forward only: what the eval scores. The logits are
        made `rows` rows at a time (a [rows, S, V] fp32 block at most)."""
        inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
        with self._context(tokens_BS1):
            x_BSD, _, lm_head = self._trunk(model, inputs_BS)
            out = []
            for x_bSD, t_bS in zip(x_BSD.split(rows), targets_BS.split(rows)):
                ce_bS, _ = token_losses(head_logits(x_bSD, model.final_norm, lm_head, self.cdt), t_bS)
                out.append(ce_bS.mean(-1))
        return torch.cat(out)

    def __call__(self, model: MoETransformer, tokens_BS1: torch.Tensor, optim):
        ce, z, st = self.forward(model, tokens_BS1)
        return objective(ce, z, st, optim)


def sdpa_backend(name: str | None):
    if name is None:
        return contextlib.nullcontext()
    order = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = order.pop(name)
    return sdpa_kernel([first, *order.values()], set_priority=True)
