"""Expert parallel across processes for the PyTorch engine (torch.distributed, one process per
device: NCCL on GPUs, gloo on CPUs).

Rank r of ep = model.ep_size ranks holds
- the tokens of source shard r: the step's batch split into ep contiguous equal parts (whole
  sequences, so attention stays local; needs batch % ep == 0), which is exactly the source shard
  of engines/dispatch_ref.py for the row-major flattened tokens;
- the routed experts of shard r, [r * E/ep, (r+1) * E/ep), resident (never gathered in a step);
- a replica of every other parameter (embeddings, attention, norms, router, latent, shared
  experts, head), whose gradients are summed over the ranks after the backward (DDP-style).

Capacity dispatch is the pooled-wave transport of engines/dispatch_ref.py over real ranks: per
wave one fixed-shape send buffer [ep, C_send, L + 1] (the destination-local expert id in the last
column, -1 in unused rows) goes through dist.all_to_all_single; the receiver ranks its arrivals
per local expert in (wave, source, row) order, keeps at most C_recv, runs its experts on a fixed
[E/ep, C_recv, L] buffer, and the outputs go back the same way. Drops are counted where they
happen (send drops at the source, receive drops at the destination) and summed over ranks. The
same rules as the emulated shards of engines/torch/dispatch.py (Capacity), so the same drops by
construction.

Dropless dispatch with ep > 1 uses a ragged all-to-all: counts per (destination, local expert)
first, then the rows with variable split sizes (one host sync per layer for the sizes).

Every rank runs the fast forward of engines/torch/fast.py on its model: the module tree of
engines/torch/model.py with this rank's experts, whose dispatcher is PooledWave (capacity) or
Ragged (dropless) below instead of the one-device ones. Its backward seeds its share of the
global objective (model.sharded_objective), so summed dense gradients and the experts' gradients
(which arrive through the all-to-all's backward from every rank) are the single-device gradients.

Shape legend as in model.py, plus: t tokens of this rank, e experts of this rank, P ranks (ep),
W waves, C sender rows per pool, X arrivals at this rank (W * P * C), R receiver rows per expert.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from core.spec import ModelSpec
from engines.dispatch_ref import capacities
from engines.options import TorchKernels
from engines.torch.experts import grouped_swiglu, kernels_here, swiglu_padded
from engines.torch.fast import FastLoss
from engines.torch.model import Experts, MoETransformer, sharded_objective
from engines.torch.rows import RowGather, group_counts, partial_inverse, rank_within

EXPERT_MARK = ".moe.experts."
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class EPError(ValueError):
    """A run that cannot be laid out over the ranks; the message says what and how to fix it."""


@dataclass
class EPContext:
    """This process's place in the expert-parallel group."""

    rank: int
    size: int
    device: torch.device
    group: dist.ProcessGroup | None = None

    def experts(self, m: ModelSpec) -> tuple[int, int]:
        """[first, last) routed expert held by this rank."""
        e = m.n_routed_experts // self.size
        return self.rank * e, (self.rank + 1) * e


def is_expert_param(name: str) -> bool:
    return EXPERT_MARK in name


def check_layout(m: ModelSpec, world_size: int, batch_size: int) -> None:
    if m.ep_size != world_size:
        raise EPError(
            f"model.ep_size is {m.ep_size} but {world_size} process(es) were started: launch "
            f"`torchrun --nproc_per_node {m.ep_size} -m engines.torch.ep_train ...` (or use `ladder train` "
            f"to emulate the {m.ep_size} shards on one device)")
    if batch_size % world_size:
        raise EPError(f"data.batch_size ({batch_size}) must be a multiple of model.ep_size ({world_size}): "
                      "each rank holds whole sequences of its source shard")


# ---- the per-rank model ---------------------------------------------------------------------------


def build_local_model(m: ModelSpec, ctx: EPContext) -> MoETransformer:
    """The model of the spec with only this rank's routed experts (same parameter names; the
    expert stacks have E/ep rows). Built on the meta device, so no rank ever allocates all the
    experts; load weights with load_local() before use."""
    dispatcher = PooledWave(m, ctx) if m.dispatch == "capacity" else Ragged(m, ctx)
    with torch.device("meta"):
        model = MoETransformer(m)
        for blk in model.blocks:
            blk.moe.experts = Experts(m.n_routed_experts // ctx.size, m.expert_dim, m.expert_hidden, dispatcher)
    return model.to_empty(device=ctx.device)


def local_slice(arrays: dict[str, np.ndarray], m: ModelSpec, ctx: EPContext) -> dict[str, np.ndarray]:
    """This rank's view of full (engine-neutral) arrays, parameters or AdamW moments ("m/<name>"):
    expert stacks sliced to its experts, the rest as it is."""
    lo, hi = ctx.experts(m)
    return {k: (a[lo:hi] if is_expert_param(k) and np.ndim(a) >= 1 else a) for k, a in arrays.items()}


def load_local(model: MoETransformer, arrays: dict[str, np.ndarray], ctx: EPContext) -> None:
    model.load_numpy(local_slice(arrays, model.m, ctx))


def gather_experts(arrays: dict[str, np.ndarray], ctx: EPContext) -> dict[str, np.ndarray] | None:
    """Full arrays on rank 0 (None elsewhere): every key naming an expert stack is gathered over
    the ranks and concatenated in rank order; the rest is taken as it is (replicated)."""
    out = {}
    for k in sorted(arrays):
        a = arrays[k]
        if is_expert_param(k) and np.ndim(a) >= 1:
            t = torch.from_numpy(np.ascontiguousarray(a)).to(ctx.device)
            parts = [torch.empty_like(t) for _ in range(ctx.size)]
            dist.all_gather(parts, t, group=ctx.group)
            if ctx.rank == 0:
                out[k] = np.concatenate([p.cpu().numpy() for p in parts], 0)
        elif ctx.rank == 0:
            out[k] = a
    return out if ctx.rank == 0 else None


# ---- collectives with autograd ------------------------------------------------------------------


class Counters:
    """Collective calls made by this process (the run summary reports them)."""

    all_to_all = 0
    all_reduce = 0


def _a2a_waves(x_WRL: torch.Tensor, group) -> torch.Tensor:
    """One all_to_all_single per wave, every wave the same shape (all in flight at once)."""
    x_WRL = x_WRL.contiguous()
    out = torch.empty_like(x_WRL)
    works = [dist.all_to_all_single(out[w], x_WRL[w], group=group, async_op=True) for w in range(x_WRL.shape[0])]
    for h in works:
        h.wait()
    Counters.all_to_all += len(works)
    return out


class WaveExchange(torch.autograd.Function):
    """Fixed-split all-to-all per wave; with equal splits its transpose is itself, so the
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x_WRL, group):
        ctx.group = group
        return _a2a_waves(x_WRL, group)

    @staticmethod
    def backward(ctx, g_WRL):
        return _a2a_waves(g_WRL, ctx.group), None


def _a2a_ragged(x_NL: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    out = x_NL.new_empty((sum(out_rows), x_NL.shape[-1]))
    dist.all_to_all_single(out, x_NL.contiguous(), output_split_sizes=out_rows, input_split_sizes=in_rows,
                           group=group)
    Counters.all_to_all += 1
    return out


class _RaggedExchange(torch.autograd.Function):
    """All-to-all with variable split sizes; the backward swaps input and output sizes."""

    @staticmethod
    def forward(ctx, x_NL, send_rows, recv_rows, group):
        ctx.sizes, ctx.group = (send_rows, recv_rows), group
        return _a2a_ragged(x_NL, recv_rows, send_rows, group)

    @staticmethod
    def backward(ctx, g_ML):
        send_rows, recv_rows = ctx.sizes
        return _a2a_ragged(g_ML, send_rows, recv_rows, ctx.group), None, None, None


def all_reduce_sum(t: torch.Tensor, ctx: EPContext) -> torch.Tensor:
    if ctx.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ctx.group)
        Counters.all_reduce += 1
    return t


# ---- dispatch -----------------------------------------------------------------------------------


def pooled_wave_experts(experts: Experts, x_tL: torch.Tensor, expert_tK: torch.Tensor, m: ModelSpec,
                        n_tokens: int, ctx: EPContext, cdt: torch.dtype):
    """Capacity dispatch of this rank's tokens over the ranks. n_tokens: tokens of the whole
    step (all ranks), which sets C_recv. Returns (y_tKL in (token, slot) order, zero rows for
    dropped assignments; send drops made here; receive drops made here) as float tensors."""
    t, K = expert_tK.shape
    L = x_tL.shape[-1]
    P, W = ctx.size, m.n_waves
    e_loc = m.n_routed_experts // P
    c_send, c_recv = capacities(n_tokens, K, m.n_routed_experts, P, W, m.capacity_factor_send,
                                m.capacity_factor_recv)
    # bf16 holds every integer up to 256 exactly: larger local expert ids ride in fp32 rows
    wire = cdt if (cdt == torch.float32 or e_loc <= 256) else torch.float32
    # sender: assignments in priority order (slot-major, then token), one pool per destination and wave
    e_A = expert_tK.t().reshape(-1)
    dst_A = e_A // e_loc
    pos_A = rank_within(dst_A, P)
    sent_A = pos_A < W * c_send
    n_slots = W * P * c_send
    # flat index of each sent assignment in the [W, P, C] buffer; n_slots (an empty row) if dropped
    at_A = torch.where(sent_A, ((pos_A // c_send) * P + dst_A) * c_send + pos_A % c_send,
                       torch.full_like(pos_A, n_slots))
    filler_S = partial_inverse(at_A, n_slots)  # the assignment filling each slot
    ids_S = torch.cat([(e_A - dst_A * e_loc).to(wire), x_tL.new_full((1,), -1.0, dtype=wire)])[filler_S]
    # x_tL[tok_A] for slot-major assignments; repeat's backward sums the K slots
    x_SL = RowGather.apply(x_tL.to(wire).repeat(K, 1), filler_S, at_A)
    send_WRL1 = torch.cat([x_SL, ids_S.unsqueeze(-1)], -1).view(W, P * c_send, L + 1)
    recv_WRL1 = WaveExchange.apply(send_WRL1, ctx.group)
    # receiver: arrivals in (wave, source, row) order, ranked per local expert
    arr_XL1 = recv_WRL1.reshape(n_slots, L + 1)
    le_X = arr_XL1[:, L].detach().round().long()
    valid_X = le_X >= 0
    rank_X = rank_within(torch.where(valid_X, le_X, e_loc), e_loc + 1)
    kept_X = valid_X & (rank_X < c_recv)
    n_buf = e_loc * c_recv
    slot_X = torch.where(kept_X, le_X * c_recv + rank_X, torch.full_like(rank_X, n_buf))
    filler_B = partial_inverse(slot_X, n_buf)  # the arrival filling each buffer row
    buf_eRL = RowGather.apply(arr_XL1[:, :L].to(cdt), filler_B, slot_X).view(e_loc, c_recv, L)
    out_eRL = swiglu_padded(experts, buf_eRL, cdt)
    y_WRL = RowGather.apply(out_eRL.reshape(n_buf, L).to(wire), slot_X, filler_B).view(W, P * c_send, L)
    back_WRL = WaveExchange.apply(y_WRL, ctx.group)  # unkept and empty rows carry zeros back
    # back at the source: each assignment reads its row (the zero row if dropped anywhere)
    y_tKL = RowGather.apply(back_WRL.reshape(n_slots, L), at_A, filler_S).view(K, t, L).transpose(0, 1)
    n_send = (~sent_A).sum().float()
    n_recv = (valid_X & ~kept_X).sum().float()
    return y_tKL, n_send, n_recv


def ragged_experts(w_gu: torch.Tensor, w_down: torch.Tensor, x_tL: torch.Tensor, expert_tK: torch.Tensor,
                   m: ModelSpec, ctx: EPContext, cdt: torch.dtype, o: TorchKernels | None = None) -> torch.Tensor:
    """Dropless dispatch over the ranks: every assignment reaches its expert (variable-size
    all-to-all); w_gu [e, L, 2F] (gate|up) and w_down [e, F, L] are this rank's experts in cdt
    (o: the kernels of the grouped SwiGLU, default the engine's). Returns y_tKL in (token, slot) order."""
    o = o or kernels_here(TorchKernels())

    t, K = expert_tK.shape
    P = ctx.size
    e_loc = m.n_routed_experts // P
    e_A = expert_tK.reshape(-1)  # token-major: a = token * K + slot
    order_A = torch.argsort(e_A, stable=True)  # by global expert = by (destination, local expert)
    counts_E = group_counts(e_A, m.n_routed_experts)
    recv_counts_E = torch.empty_like(counts_E)  # [P sources, e local experts] once reshaped
    dist.all_to_all_single(recv_counts_E, counts_E, group=ctx.group)
    Counters.all_to_all += 1
    both = torch.stack([counts_E.view(P, e_loc).sum(1), recv_counts_E.view(P, e_loc).sum(1)]).tolist()
    send_rows, recv_rows = both
    x_AL = x_tL.to(cdt)[order_A // K]
    x_NL = _RaggedExchange.apply(x_AL, send_rows, recv_rows, ctx.group)  # (source, local expert) order
    le_N = torch.repeat_interleave(torch.arange(e_loc, device=x_tL.device).repeat(P), recv_counts_E)
    order_N = torch.argsort(le_N, stable=True)
    y_sorted_NL = grouped_swiglu(x_NL[order_N], group_counts(le_N, e_loc), w_gu, w_down, cdt, o)
    y_NL = torch.empty_like(y_sorted_NL).index_copy(0, order_N, y_sorted_NL)
    y_sorted_AL = _RaggedExchange.apply(y_NL, recv_rows, send_rows, ctx.group)
    y_AL = torch.empty_like(y_sorted_AL).index_copy(0, order_A, y_sorted_AL)
    return y_AL.view(t, K, -1)


class PooledWave:
    """The capacity dispatcher over the ranks: pooled_wave_experts, C_recv from the step's tokens
    (every rank holds the same number)."""

    sharded = True

    def __init__(self, m: ModelSpec, ctx: EPContext):
        self.m, self.ctx = m, ctx

    def __call__(self, kern, x_TL, expert_TK, gate_TK):
        x_tL = x_TL.to(kern.cdt)
        return pooled_wave_experts(kern.experts, x_tL, expert_TK, self.m, x_tL.shape[0] * self.ctx.size, self.ctx,
                                   kern.cdt)


class Ragged:
    """The dropless dispatcher over the ranks: ragged_experts."""

    sharded = True

    def __init__(self, m: ModelSpec, ctx: EPContext):
        self.m, self.ctx = m, ctx

    def __call__(self, kern, x_TL, expert_TK, gate_TK):
        y_tKL = ragged_experts(kern.gate_up(), kern.down(), x_TL.to(kern.cdt), expert_TK, self.m, self.ctx, kern.cdt,
                               kern.o)
        zero = torch.zeros((), device=x_TL.device)
        return y_tKL, zero, zero


# ---- the per-rank objective ------------------------------------------------------------------------


class EPLoss(FastLoss):
    """This rank's share of the step objective and the step's global forward metrics: the fast
    forward (its dense parts compiled on a GPU, the dispatch eager) on a model of
    build_local_model, then model.sharded_objective.

    __call__(model, tokens_bS1, optim, n_tokens) -> (total_r, out): total_r is this rank's share
    (sum over ranks = the single-device objective); out["global"] holds the global metrics of
    model.loss_terms (already summed over ranks) and out["load_LE"] the global expert loads."""

    def __init__(self, model: MoETransformer, ctx: EPContext, kernels: TorchKernels | None = None):
        o = kernels or kernels_here(TorchKernels())
        cuda = ctx.device.type == "cuda"
        super().__init__(model, ctx.device, o, compile="dense" if cuda and o.compile != "none" else "none")
        self.ctx = ctx

    def embed(self, model: MoETransformer, inputs_bS: torch.Tensor) -> torch.Tensor:
        return model.embed.weight[inputs_bS]

    def __call__(self, model: MoETransformer, tokens_bS1: torch.Tensor, optim, n_tokens: int):
        ce, z, st = self.forward(model, tokens_bS1)
        return sharded_objective(ce, z, st, optim, model.m, n_tokens, self.ctx.size,
                                 lambda t: all_reduce_sum(t, self.ctx))


def step_metrics(out: dict, aux: torch.Tensor, total: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics of model.loss_terms (global) from EPLoss's output and the summed aux/total."""
    g, load_LE = out["global"], out["load_LE"]
    return {
        "loss": g["loss"],
        "z_loss": g["z_loss"],
        "aux_loss": aux,
        "router_z_loss": g["router_z_loss"],
        "drop_frac_send": g["drop_send"],
        "drop_frac_recv": g["drop_recv"],
        "expert_load_max": (load_LE.max(-1).values / load_LE.mean(-1)).max(),
        "router_entropy": g["router_entropy"],
        "total_loss": total,
    }


# ---- gradients --------------------------------------------------------------------------------------


def reduce_and_clip(model: MoETransformer, ctx: EPContext, max_norm: float, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the dense gradients over the ranks (one flat all-reduce, which also sums `extra`, a
    small vector riding along), then clip every gradient by the global norm (dense once + every
    rank's experts), as torch.nn.utils.clip_grad_norm_ does on one device.
    Returns (the global grad norm before clipping, extra summed over ranks)."""
    dense, expert = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        (expert if is_expert_param(name) else dense).append(p.grad)
    expert_sq = torch.stack([g.float().pow(2).sum() for g in expert]).sum() if expert else torch.zeros((), device=ctx.device)
    flat = torch.cat([g.reshape(-1) for g in dense] + [expert_sq.view(1).to(dense[0].dtype), extra.to(dense[0].dtype)])
    flat = all_reduce_sum(flat, ctx)
    n_dense = flat.shape[0] - 1 - extra.shape[0]
    offset = 0
    for g in dense:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
    dense_sq = flat[:n_dense].float().pow(2).sum()
    total_norm = (dense_sq + flat[n_dense].float()).sqrt()
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(dense + expert, clip_coef)
    return total_norm, flat[n_dense + 1:]


def local_device(device: str | None, local: int, error: type[Exception]) -> torch.device:
    """This process's device: CUDA device `local` (made current) when asked for or available,
    else the CPU; `error` names a local rank without a GPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    if torch.cuda.device_count() <= local:
        raise error(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev


def join_process_group(dev: torch.device, rank: int, world: int) -> None:
    """torch.distributed's default group, unless one exists: NCCL on a GPU, else gloo; the
    rendezvous from torchrun's environment (127.0.0.1 and a free port for a single process)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world == 1:
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)


def setup_from_env(device: str | None = None) -> EPContext:
    """Join (or start) the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT); a plain process is a group of one. NCCL on CUDA, gloo on the CPU."""
    for var, off in NO_MULTICAST.items():  # NVLink multicast stays off, as the machines set it
        os.environ.setdefault(var, off)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = local_device(device, local, EPError)
    join_process_group(dev, rank, world)
    return EPContext(rank=dist.get_rank(), size=dist.get_world_size(), device=dev, group=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
