"""The torch engine's optimizers and their one builder (build_optimizer, for the one-device step
and every layout's): AdamW with decoupled weight decay on matrices and expert stacks only.

MasterAdamW: AdamW over fp32 master weights that writes the 16-bit working copies of the matrices
in the same pass: the optimizer of the torch engine (engines/torch/forward.py reads its working copies).

With plain fp32 parameters, a bf16 step pays on every matrix: a cast to bf16 in the forward, a
bf16 -> fp32 cast of its gradient in the backward, clip_grad_norm_'s multiply over the fp32
gradient, and then the optimizer's own pass. Here the matmuls read bf16 leaf tensors (the working
copies, whose gradients stay bf16); the grad norm is read from those gradients; and one kernel per
tensor reads master, gradient, moments and the clip divisor and writes master, moments and working
copy (28 bytes a parameter).

Working copies: one leaf per weight the forward reads (`weight_layout`): attention's q, k
and v side by side ([D, (H + 2G) Q]), the experts' gate and up side by side ([E, L, 2F]), every
other matrix alone. Parts are concatenated along the last dimension, so a master parameter is a
slice of its leaf's last dimension and its gradient the same slice of the leaf's gradient.

Update, state keys and state dtypes are torch.optim.AdamW's (decoupled weight decay, bias
corrections; step, exp_avg and exp_avg_sq in fp32), so checkpoints, resumes and
engine.optimizer_to_numpy are unchanged. Parameters without a working copy (norms, the router,
the embedding, which stay fp32 in the forward) get the same update from their fp32 gradients.

With moments=torch.bfloat16 (a spec's optim.moments "bf16") exp_avg and exp_avg_sq are kept in
bf16, as DeepSeek-V3 trained (its report, section 3.3.2, with beta2 0.95): 20 bytes a parameter
instead of 28. The arithmetic stays fp32; checkpoints hold them as fp32 and a load rounds them
back.

Shape legend: N... a tensor's dimensions (any rank).
"""

from __future__ import annotations

import math

import torch

from engines.torch.kernels import adamw_kernel
from engines.torch.kernels.adamw_kernel import adamw_launch, kernel_usable
from core.spec import BF16_MOMENTS_MAX_BETA2, OptimSpec
from engines.torch.model import MoETransformer


def default_kernel() -> str:
    """MasterAdamW's update kernel unless one is given (engines/options.TorchKernels.adamw):
    "triton" where Triton is installed. On an H200 at the bench shape the Triton kernel gave +4%
    tokens/s over Inductor's graphs with the same losses, and needs no compile (1 s of warm-up
    against 72)."""
    return "triton" if adamw_kernel.triton is not None else "compile"


def weight_layout(model: MoETransformer) -> dict[str, list[torch.nn.Parameter]]:
    """Working-copy name -> the master parameters it holds, concatenated along the last dim.
    Block weights are named blocks.<i>.<key> with the keys the forward reads."""
    out: dict[str, list[torch.nn.Parameter]] = {}
    for i, blk in enumerate(model.blocks):
        a, moe = blk.attn, blk.moe
        out[f"blocks.{i}.attn.qkv"] = [a.wq, a.wk, a.wv]
        out[f"blocks.{i}.attn.wo"] = [a.wo]
        out[f"blocks.{i}.moe.experts.gate_up"] = [moe.experts.w_gate, moe.experts.w_up]
        out[f"blocks.{i}.moe.experts.w_down"] = [moe.experts.w_down]
        if moe.m.latent_dim is not None:
            out[f"blocks.{i}.moe.latent_down"] = [moe.latent_down]
            out[f"blocks.{i}.moe.latent_up"] = [moe.latent_up]
        if moe.m.n_shared_experts > 0:
            out[f"blocks.{i}.moe.shared.gate_up"] = [moe.shared.w_gate, moe.shared.w_up]
            out[f"blocks.{i}.moe.shared.w_down"] = [moe.shared.w_down]
    out["lm_head"] = [model.lm_head]
    return out


def adamw_(p_N, g_N, m_N, v_N, w_N, s_9):
    """One AdamW update in place; w_N (or None) receives the new master in its dtype.
    s_9 (fp32): step size lr / (1 - b1^t), decay factor 1 - lr * wd, 1 - b1, b2, 1 - b2, eps,
    1 / sqrt(1 - b2^t), the clip multiplier min(clip / (norm + 1e-6), 1), and 1 if the step's
    loss and grad norm are finite, else 0: then nothing changes. The check on the device lets
    the host queue the update before it reads the step's metrics (its one sync per step)."""
    ok = s_9[8] > 0
    g_N = g_N.float() * s_9[7]
    m_new = torch.lerp(m_N.float(), g_N, s_9[2])  # (16-bit moments: fp32 arithmetic, rounded on the copy)
    v_new = v_N.float() * s_9[3] + g_N * g_N * s_9[4]
    p_new = p_N * s_9[1] - m_new / (v_new.sqrt() * s_9[6] + s_9[5]) * s_9[0]
    m_N.copy_(torch.where(ok, m_new, m_N))
    v_N.copy_(torch.where(ok, v_new, v_N))
    p_N.copy_(torch.where(ok, p_new, p_N))
    if w_N is not None:
        w_N.copy_(p_N)


def _each_tensor(update, ps, gs, ms, vs, leaves, leaf_grads, parts, s_9):
    """update(p, g, m, v, w, s_9) for every tensor of a group. parts[i] is None (gs[i] is the
    gradient, no working copy) or (leaf index, start, stop): the gradient and working copy are that
    slice of leaf_grads[j] and leaves[j]. Leaves come whole and are sliced here because the
    compiler cannot take several mutated views of one storage as inputs."""
    for p, g, m, v, part in zip(ps, gs, ms, vs, parts):
        if part is None:
            update(p, g, m, v, None, s_9)
        else:
            j, a, b = part
            update(p, leaf_grads[j][..., a:b], m, v, leaves[j][..., a:b], s_9)


def adamw_group_(ps, gs, ms, vs, leaves, leaf_grads, parts, s_9):
    """adamw_ over a parameter group (see _each_tensor). Compiled on a GPU as one graph per group:
    shapes, strides and slices repeat every step, so it compiles once."""
    _each_tensor(adamw_, ps, gs, ms, vs, leaves, leaf_grads, parts, s_9)


def adamw_group_kernels_(ps, gs, ms, vs, leaves, leaf_grads, parts, s_9):
    """The same update with one Triton kernel per tensor (engines/torch/kernels/adamw_kernel.py)."""
    _each_tensor(adamw_launch, ps, gs, ms, vs, leaves, leaf_grads, parts, s_9)


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in fp32, by one torch._foreach_norm per dtype. CUDA's multi-tensor
    kernel (one launch for a whole list) takes lists of one dtype only: given the bf16 working
    copies' gradients and the fp32 ones together it falls back to one reduction per tensor (88
    launches, 1.3 ms a step on an H200 at the bench shape)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in by_dtype.values():
        for i, n in zip(idx, torch._foreach_norm([tensors[i] for i in idx], 2, dtype=torch.float32)):
            out[i] = n
    return out


class MasterAdamW(torch.optim.Optimizer):
    """AdamW on fp32 masters + working copies in `dtype` (see the module docstring).

    Step protocol: forward/backward through `working()`; norm, mult = `grad_norm_and_scale(clip)`;
    `step(mult, finite)`; `zero_grad()`; read the metrics (rewind() if they were not finite)."""

    def __init__(self, model: MoETransformer, param_groups, lr: float, betas: tuple[float, float],
                 eps: float, dtype: torch.dtype = torch.bfloat16, compile: bool | None = None,
                 kernel: str | None = None, moments: torch.dtype = torch.float32):
        super().__init__(param_groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        if moments not in (torch.float32, torch.bfloat16):
            raise ValueError(f"MasterAdamW moments {moments}: torch.float32 or torch.bfloat16")
        if moments == torch.bfloat16 and any(g["betas"][1] > BF16_MOMENTS_MAX_BETA2 for g in self.param_groups):
            raise ValueError(f"MasterAdamW: bf16 moments need beta2 <= {BF16_MOMENTS_MAX_BETA2} (got "
                             f"{max(g['betas'][1] for g in self.param_groups)}); above it, a "
                             "step's change to the second moment is lost in bf16's rounding")
        self.dtype, self.moments = dtype, moments
        self._leaves: dict[str, torch.Tensor] = {}
        self._part: dict[torch.nn.Parameter, tuple[str, int, int]] = {}  # param -> (leaf, start, stop)
        for name, parts in weight_layout(model).items():
            start = 0
            for p in parts:
                self._part[p] = (name, start, start + p.shape[-1])
                start += p.shape[-1]
            shape = (*parts[0].shape[:-1], start)
            self._leaves[name] = torch.empty(shape, dtype=dtype, device=parts[0].device, requires_grad=True)
        self._stale = True
        # "triton": one hand-written kernel per tensor where Triton runs (else the torch form);
        # "compile": Inductor's kernels, one graph per parameter group
        self.kernel = kernel or default_kernel()
        if self.kernel not in ("compile", "triton"):
            raise ValueError(f"MasterAdamW kernel {self.kernel!r}: 'compile' or 'triton'")
        first = next(model.parameters())
        use_compile = compile if compile is not None else first.is_cuda
        if self.kernel == "triton" and kernel_usable(first):
            self._update = adamw_group_kernels_
        elif self.kernel == "compile" and use_compile:
            self._update = torch.compile(adamw_group_, dynamic=False)
        else:
            self._update = adamw_group_

    # ---- working copies --------------------------------------------------------------------

    def working(self) -> dict[str, torch.Tensor]:
        """name -> working-copy leaf (refreshed from the masters first if they were loaded)."""
        if self._stale:
            self.refresh()
        return self._leaves

    def with_working_copy(self) -> list[torch.nn.Parameter]:
        """The master parameters whose gradients land on a working copy's leaf."""
        return list(self._part)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy every master into its working copy (after the masters were set from outside)."""
        for p, (name, a, b) in self._part.items():
            self._leaves[name].detach()[..., a:b].copy_(p)
        self._stale = False

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # (which casts the moments to the fp32 masters' dtype)
        for st in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    st[key] = st[key].to(self.moments)
        self._stale = True

    # ---- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def grad_norm_and_scale(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(global grad norm, clip multiplier) on the device, gradients untouched; the multiplier
        is clip_grad_norm_'s min(max_norm / (norm + 1e-6), 1). Norms are read per whole leaf
        gradient (contiguous) rather than per parameter slice."""
        grads = [leaf.grad for leaf in self._leaves.values() if leaf.grad is not None]
        grads += [p.grad for g in self.param_groups for p in g["params"] if p not in self._part and p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack(foreach_norms(grads)))
        return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)

    def rewind(self) -> None:
        """Undo the step count of a step whose finite flag was 0 (its update changed nothing)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and int(st["step"]) > 0:
                    st["step"] -= 1

    @torch.no_grad()
    def step(self, clip_mult: torch.Tensor | None = None, finite: torch.Tensor | None = None, closure=None):
        """The update of every parameter with a gradient; clip_mult multiplies the gradients and a
        false `finite` (device bool) makes it change nothing (call rewind() once that is known)."""
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        if self._stale:  # a step before any forward read the copies
            self.refresh()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            ps, gs, ms, vs, parts = [], [], [], [], []
            leaves, leaf_grads, leaf_index = [], [], {}
            for p in group["params"]:
                part = self._part.get(p)
                g = p.grad if part is None else self._leaves[part[0]].grad
                if g is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moments, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moments, memory_format=torch.contiguous_format)
                st["step"] += 1
                ps.append(p)
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
                if part is None:
                    gs.append(g)
                    parts.append(None)
                    continue
                name, a, b = part
                if name not in leaf_index:
                    leaf_index[name] = len(leaves)
                    leaves.append(self._leaves[name].detach())
                    leaf_grads.append(g)
                gs.append(None)
                parts.append((leaf_index[name], a, b))
            if not ps:
                continue
            t = int(self.state[ps[0]]["step"])  # a group's tensors are stepped together
            host = torch.tensor([lr / (1 - b1**t), 1 - lr * wd, 1 - b1, b2, 1 - b2, eps,
                                 1 / math.sqrt(1 - b2**t)], dtype=torch.float32)
            dev = ps[0].device
            if dev.type == "cuda":  # a pageable upload would wait for the stream (the backward)
                host = host.pin_memory()
            s_9 = torch.cat([host.to(dev, non_blocking=True),
                             (clip_mult if clip_mult is not None else torch.ones((), device=dev)).reshape(1).float(),
                             (finite if finite is not None else torch.ones((), device=dev)).reshape(1).float()])
            self._update(ps, gs, ms, vs, leaves, leaf_grads, parts, s_9)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for leaf in self._leaves.values():
            leaf.grad = None


class GuardedAdamW(torch.optim.AdamW):
    """torch's fused AdamW with MasterAdamW's step protocol: step(clip_mult, finite) with the
    step's finiteness on the device, so the update is queued before the host has read the step
    (engines/lookahead.py). A false `finite` goes to the fused kernel as its found_inf: it skips
    the update and takes back the step count, on the device. Clipping stays clip_grad_norm_'s
    (clip_mult is accepted and must be None)."""

    def __init__(self, params, **kw):
        super().__init__(params, fused=True, **kw)

    @torch.no_grad()
    def step(self, clip_mult: torch.Tensor | None = None, finite: torch.Tensor | None = None, closure=None):
        if clip_mult is not None or closure is not None:
            raise ValueError("GuardedAdamW.step takes no clip multiplier or closure (clip the gradients first)")
        self.found_inf = None if finite is None else (~finite).float()
        try:
            return super().step()
        finally:
            self.found_inf = None


# ---- the builder ---------------------------------------------------------------------------------


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two parameter groups: matrices and expert stacks (ndim >= 2) decay, norms and other
    vectors do not; each in the model's parameter order."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim: OptimSpec, *, working: torch.dtype | None = None,
                    kernel: str | None = None, sharded: torch.device | None = None) -> torch.optim.Optimizer:
    """The AdamW of a step (optim: the spec's peak LR, betas, eps, weight decay and moments dtype).

    working: the dtype of the working copies the forward reads (the step decides it:
    engines/torch/forward.working_dtype): MasterAdamW, its update by `kernel` (default_kernel()).
    Without them: torch's AdamW. One device (sharded None): GuardedAdamW, torch's fused kernel,
    whose step takes the step's finiteness on the device (the update is queued before the step is
    read). A layout's FSDP2-sharded parameters on `sharded` (their device): torch's AdamW, fused on a
    GPU, foreach elsewhere, stepped by the caller only after a finite step. Moments are fp32, or
    bf16 (optim.moments) where MasterAdamW keeps them: any other optimizer refuses bf16 moments."""
    o = optim
    groups = decay_groups(model, o.weight_decay)
    hyper = {"lr": o.peak_lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    if working is not None:
        if sharded is not None:
            raise ValueError("MasterAdamW's working copies are a one-device optimizer's (no sharded parameters)")
        return MasterAdamW(model, groups, **hyper, kernel=kernel, dtype=working,
                           moments=torch.bfloat16 if o.moments == "bf16" else torch.float32)
    if o.moments != "fp32":  # only MasterAdamW stores moments off the parameters' dtype
        raise ValueError("optim.moments bf16 needs the torch engine's MasterAdamW; this trainer uses torch's "
                         "AdamW, whose moments take the fp32 parameters' dtype")
    if sharded is None:
        return GuardedAdamW(groups, **hyper)
    return torch.optim.AdamW(groups, **hyper, **({"fused": True} if sharded.type == "cuda" else {"foreach": True}))
