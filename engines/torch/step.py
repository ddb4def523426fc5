"""The torch engine's step (engines/trainer.py's step module, TorchStep) on one device and on every
layout: replicated (every rank holds the dense parameters and its expert shard whole:
engines/torch/parallel/replicate.py adds the gradient sums and the global norm) or sharded by FSDP2
(engines/torch/parallel/fully_shard.py), and the step
helpers the bench drives it with: the loss (the model's one forward, engines/torch/forward.py,
with the kernels the options choose, and what it reads: forward.working_dtype), the
optimizer (engines/torch/master.build_optimizer, the one builder), launching a step without waiting for it,
queueing its update and reading its metrics back with the step's one host sync.

Nothing in a step is random (no dropout; the token stream is counter-based), so a checkpoint's
weights, router-bias buffers, AdamW moments and step count are the whole training state: a
resumed run replays the same batches and, on the CPU, reaches bit-identical weights.

Metrics: loss is the data cross-entropy; z_loss the mean squared log-partition of the output
(before its coefficient); aux_loss the Switch balancing loss and extra.router_z_loss the router
z-loss (both before their coefficients, mean over layers); extra.total_loss the objective;
drop fractions are shares of the step's T*K expert assignments (all layers); expert_load_max is
the worst layer's max/mean expert load; router_entropy the mean per-token entropy (nats).
A NaN or inf loss or grad norm makes the optimizer skip that step's update on the device.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from core.costs import flops_per_token
from core.spec import Spec
from engines.options import EngineOptions
from engines.torch.forward import Forward, fast_path_enabled, kernels_for, working_dtype
from engines.torch.master import MasterAdamW, build_optimizer
from engines.torch.model import MoETransformer, init_params, move_router_bias
from engines.torch.parallel import replicate
from engines.torch.parallel.layout import Layout, check_layout
from engines.torch.parallel.fsdp import expert_slice
from engines.torch.parallel.fully_shard import FullyShard
from engines.torch.parallel.model import ShardedLoss, gather_experts, layout_eval_losses, layout_model, step_metrics
from engines.torch.parallel.summary import write_summary
from engines.trainer import FINITE_KEYS, METRIC_KEYS, VALUE_KEYS


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _flops_per_token(spec: Spec, seq_len: int) -> float:
    return float(flops_per_token(spec, seq_len))


def cpu_threads(spec: Spec, options: EngineOptions | None = None) -> int | None:
    """Threads for a CPU run: options.cpu_threads (the spec's options, or $MOE_LADDER_OPTIONS cpu_threads), else one for tiny
    steps (thread start-up and spinning cost more than they save there, badly so on a busy
    machine), else torch's own. Fixed per spec, so a resumed run uses the same count as the run
    it continues."""
    if options is not None and options.cpu_threads:
        return options.cpu_threads
    step_flops = _flops_per_token(spec, spec.data.seq_len) * spec.data.tokens_per_step
    return 1 if step_flops < 2e10 else None


def make_loss_fn(model: MoETransformer, device: torch.device, working: MasterAdamW | None = None,
                 options: EngineOptions | None = None) -> Forward:
    """The step's objective: the model's forward with the kernels the options choose here
    (forward.kernels_for), reading the working copies of `working`, the step's MasterAdamW, when
    it keeps them."""
    return Forward(device, kernels_for(device, options or EngineOptions()), working=working)


def launch_step(model: MoETransformer, loss_fn, x: torch.Tensor, spec: Spec,
                opt: torch.optim.Optimizer | None = None) -> tuple[torch.Tensor, dict]:
    """Forward, backward and the grad norm of one step, queued on the device without waiting for
    it: (the step's metrics and grad norm stacked in VALUE_KEYS order, loss_fn's
    outputs). Clipping: clip_grad_norm_ on the parameters, or, for an optimizer with
    grad_norm_and_scale (MasterAdamW), a multiplier its step applies as it reads the gradients."""
    total_loss, out = loss_fn(model, x, spec.optim)
    total_loss.backward()
    if hasattr(opt, "grad_norm_and_scale"):
        grad_norm, out["clip_mult"] = opt.grad_norm_and_scale(spec.optim.grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), spec.optim.grad_clip)
    return torch.stack([out["metrics"][k].float() for k in METRIC_KEYS] + [grad_norm.float()]), out


def to_device(batch: np.ndarray, device: torch.device) -> torch.Tensor:
    """A token batch as int64 on the device without a stream sync: a copy from pageable host
    memory first waits for everything queued on the stream (CUDA's rule for pageable
    host-to-device copies), which would stop the host from launching a step while the previous one
    runs; from pinned memory the copy is queued like a kernel."""
    x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.int64))
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's copy on its way to the host, queued where it is made. Reading it waits for
    the kernels queued before the copy only: a plain .tolist() later would queue its copy behind
    every kernel launched since (the next step's included) and wait for all of them."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


_FINITE_AT = tuple(VALUE_KEYS.index(k) for k in FINITE_KEYS)


def queue_update(model: MoETransformer, opt: torch.optim.Optimizer, vals: torch.Tensor, out: dict,
                 spec: Spec) -> HostCopy:
    """The step's metrics sent towards the host, then its update and router-bias move, all queued
    on the device without waiting for them; the update and bias move change nothing when the
    step's loss or grad norm is not finite (checked on the device). Returns the metrics' HostCopy
    for read_step."""
    pending = HostCopy(vals)
    # scalar views stacked: indexing with a host list would copy the index from pageable memory
    finite = torch.isfinite(torch.stack([vals[i] for i in _FINITE_AT])).all()
    opt.step(out.get("clip_mult"), finite=finite)
    if spec.model.router_bias_balancing:
        move_router_bias(model, out["load_LE"], spec.model.router_bias_rate, finite)
    opt.zero_grad(set_to_none=True)
    return pending


def read_step(opt: torch.optim.Optimizer, vals: HostCopy) -> tuple[dict[str, float], bool]:
    """The step's one host sync: (metrics by name, finite). A non-finite step's update was
    skipped on the device; MasterAdamW's host-side step count is taken back here."""
    m = dict(zip(VALUE_KEYS, vals.tolist()))
    finite = all(np.isfinite(m[k]) for k in FINITE_KEYS)
    if not finite and hasattr(opt, "rewind"):
        opt.rewind()
    return m, finite


def finish_step(model: MoETransformer, opt: torch.optim.Optimizer, vals: torch.Tensor, out: dict,
                spec: Spec) -> tuple[dict[str, float], bool]:
    """queue_update then read_step: a step finished before anything else is launched."""
    return read_step(opt, queue_update(model, opt, vals, out, spec))


def optimizer_to_numpy(model: MoETransformer, opt: torch.optim.AdamW) -> dict[str, np.ndarray]:
    """AdamW state as {"m/<name>", "v/<name>", "step"} (exp_avg, exp_avg_sq, updates done)."""
    out: dict[str, np.ndarray] = {}
    step = 0
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if st:
            out[f"m/{name}"] = st["exp_avg"].detach().float().cpu().numpy()
            out[f"v/{name}"] = st["exp_avg_sq"].detach().float().cpu().numpy()
            step = int(st["step"])
        else:
            out[f"m/{name}"] = np.zeros(tuple(p.shape), np.float32)
            out[f"v/{name}"] = np.zeros(tuple(p.shape), np.float32)
    out["step"] = np.asarray(step, np.int64)
    return out


def optimizer_from_numpy(model: MoETransformer, opt: torch.optim.AdamW, arrays: dict[str, np.ndarray]) -> None:
    step = int(arrays.get("step", 0))
    if step == 0:
        return  # zero moments at step 0 are exactly a fresh optimizer
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {}
    for name, p in model.named_parameters():
        m, v = arrays.get(f"m/{name}"), arrays.get(f"v/{name}")
        zeros = np.zeros(tuple(p.shape), np.float32)
        state[index[id(p)]] = {
            "step": torch.tensor(float(step), dtype=torch.float32),
            "exp_avg": torch.from_numpy(np.array(zeros if m is None else m, np.float32)).to(p.device),
            "exp_avg_sq": torch.from_numpy(np.array(zeros if v is None else v, np.float32)).to(p.device),
        }
    sd = opt.state_dict()
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _stacks(batches, n: int):
    """Consecutive runs of at most n batches of one shape."""
    chunk: list[np.ndarray] = []
    for b in batches:
        if chunk and (len(chunk) == n or b.shape[1:] != chunk[0].shape[1:]):
            yield chunk
            chunk = []
        chunk.append(b)
    if chunk:
        yield chunk


def eval_losses(loss: Forward, model: MoETransformer, batches, rows: int, device: torch.device,
                dropless: bool = True) -> list[float]:
    """Each eval batch's mean CE. Under dropless dispatch a row's tokens do not depend on the
    others', so the rows of all batches of one shape run `rows` at a time (the training batch's
    row count, so the compiled blocks see one shape; the last forward is filled up with copies of
    its first row, whose results are dropped); capacity dispatch drops by the tokens of a forward,
    so there each batch runs alone, as on every layout."""
    means: list[torch.Tensor] = []
    if not dropless:
        for b in batches:
            means.append(loss.row_ce(model, torch.from_numpy(b).to(device, dtype=torch.long)).mean())
        return torch.stack(means).cpu().tolist() if means else []
    for chunk in _stacks(batches, len(batches) or 1):
        x_NS1 = torch.from_numpy(np.concatenate(chunk)).to(device, dtype=torch.long)
        n = x_NS1.shape[0]
        ce_N = []
        for lo in range(0, n, rows):
            part = x_NS1[lo:lo + rows]
            if part.shape[0] < rows:
                part = torch.cat([part, part[:1].expand(rows - part.shape[0], -1)])
            ce_N.append(loss.row_ce(model, part)[:min(rows, n - lo)])
        means += [ce.mean() for ce in torch.split(torch.cat(ce_N), [len(b) for b in chunk])]
    return torch.stack(means).cpu().tolist() if means else []


class TorchStep:
    """The torch engine's step module (engines/trainer.py) on one device and on every rank of a
    layout (`layout`: the layout's model, this rank's rows, its share of the objective). The
    layout's dense sharding (`dense`, default replicate.dense_sharding of options.torch_dense)
    decides how the rank holds the dense parameters: "replicate" keeps them whole, with the
    one-device optimizer, compiled blocks and lookahead, and sums the gradients
    (engines/torch/parallel/replicate.py); "fsdp" shards them by FSDP2
    (engines/torch/parallel/fully_shard.FullyShard: its model, optimizer, state and update)."""

    engine = "torch"

    def __init__(self, spec: Spec, device: torch.device, options: EngineOptions | None = None,
                 layout: Layout | None = None, run_dir: Path | None = None, dense: str | None = None):
        self.spec, self.device, self.options = spec, device, options or EngineOptions()
        self.layout, self.run_dir = layout, run_dir
        self.lead = layout is None or layout.rank == 0
        self.devices = 1 if layout is None else layout.world
        if layout is not None and dense is None:
            dense = replicate.dense_sharding(spec, layout, self.options.torch_dense)
        self.sharded = FullyShard(spec, layout, kernels_for(device, self.options)) if dense == "fsdp" else None
        # a sharded step is read before the next is launched; CPU ops run as they are launched,
        # so a step's time there is its launch and read; on a GPU the host learns when a step
        # ended only at its read, so it is the time between reads
        self.lookahead = self.sharded is None
        self.synchronous = device.type == "cpu" or self.sharded is not None
        self.working = None  # what the forward reads: working copies in this dtype (MasterAdamW's) or the masters
        if self.sharded is not None:
            self.model, self.opt = self.sharded.model, self.sharded.opt
        else:
            # plain blocks: nothing hooks them, their weights are the optimizer's working copies
            self.model = (MoETransformer(spec.model) if layout is None else layout_model(spec.model, layout)).to(device)
            self.working = working_dtype(spec, device, self.options)
            self.opt = build_optimizer(self.model, spec.optim, working=self.working,
                                       kernel=kernels_for(device, self.options).adamw)
        self.loss_fn = None

    def _ready(self) -> None:
        working = self.opt if self.working is not None else None
        if self.sharded is not None:
            self.loss_fn = self.sharded.loss
        elif self.layout is None:
            self.loss_fn = make_loss_fn(self.model, self.device, working, self.options)
        else:
            self.loss_fn = ShardedLoss(self.model, self.layout, kernels_for(self.device, self.options), working)

    def _local(self, arrays: dict) -> dict:
        return arrays if self.layout is None else expert_slice(arrays, self.spec.model, self.layout)

    def init_fresh(self) -> None:
        params = init_params(self.spec.model, self.spec.seed)
        if self.sharded is not None:
            self.sharded.load(params)
        else:
            self.model.load_numpy(self._local(params))
        self._ready()

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        if self.sharded is not None:
            self.sharded.load(params, opt)
        else:
            self.model.load_numpy(self._local(params))
            optimizer_from_numpy(self.model, self.opt, self._local(opt))
        self._ready()

    def save_arrays(self) -> tuple[dict, dict] | None:
        """The whole state on the lead: on a layout, data row 0 gathers its expert shards (the
        other rows hold copies of them; under FSDP2 every rank takes part in the gathers) and the
        others return None."""
        if self.sharded is not None:
            return self.sharded.save()
        if self.layout is not None and self.layout.d != 0:
            return None
        params, opt = self.model.to_numpy(), optimizer_to_numpy(self.model, self.opt)
        if self.layout is None:
            return params, opt
        params, opt = gather_experts(params, self.layout), gather_experts(opt, self.layout)
        return (params, opt) if self.lead else None

    def batch_part(self, batch_size: int) -> tuple[int, int]:
        """On a layout each rank reads only its own sequences of a step's batch."""
        if self.layout is None:
            return 0, 1
        check_layout(self.spec.model, self.layout.world, batch_size)
        return self.layout.part, self.layout.world

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        """batch_BS1: this rank's rows of the step's batch (batch_part). Returns the step's
        HostCopy for read, or under FSDP2 its metrics and finiteness (the step already read)."""
        x = to_device(batch_BS1, self.device)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if self.sharded is not None:
            return self.sharded.step(x)
        if self.layout is None:
            vals, out = launch_step(self.model, self.loss_fn, x, self.spec, self.opt)
        else:
            vals, out = self._launch_layout(x)
        return queue_update(self.model, self.opt, vals, out, self.spec)

    def _launch_layout(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """launch_step on a rank: its share of the objective, the gradient sums, the global norm
        and clip (a multiplier MasterAdamW applies, or the gradients scaled here)."""
        lay, optim = self.layout, self.spec.optim
        n_tok = x.shape[0] * lay.world * (x.shape[1] - 1)
        total_r, out = self.loss_fn(self.model, x, optim, n_tok)
        total_r.backward()
        dense, expert = replicate.split_grads(self.model, self.opt)
        replicate.reduce_grads(dense, expert, lay)
        norm, sums = replicate.global_norm(dense, expert, torch.stack([out["aux_r"], out["total_r"]]), lay)
        mult = torch.clamp(optim.grad_clip / (norm + 1e-6), max=1.0)
        if hasattr(self.opt, "grad_norm_and_scale"):
            out["clip_mult"] = mult
        else:
            torch._foreach_mul_(dense + expert, mult)
        metrics = step_metrics(out, sums[0], sums[1])
        return torch.stack([metrics[k].float() for k in METRIC_KEYS] + [norm.float()]), out

    def read(self, pending) -> tuple[dict[str, float], bool]:
        return pending if self.sharded is not None else read_step(self.opt, pending)

    def eval_losses(self, batches) -> list[float]:
        """Each eval batch's mean CE (eval_losses); on a layout each rank scores its rows of each
        batch and the means are the global ones."""
        if self.sharded is not None:
            return self.sharded.eval_losses(batches)
        if self.layout is not None:
            return self._layout_eval_losses(batches)
        return eval_losses(self.loss_fn, self.model, batches, self.spec.data.batch_size, self.device,
                           dropless=self.spec.model.dispatch == "dropless")

    def _layout_eval_losses(self, batches) -> list[float]:
        return layout_eval_losses(lambda x, n: self.loss_fn(self.model, x, self.spec.optim, n), batches, self.layout)

    def agree(self, value):
        if self.layout is None or self.layout.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def extra(self) -> dict:
        return {} if self.layout is None else {"mesh": [self.layout.dp, self.layout.ep]}

    def describe(self) -> dict:
        out = {**describe_options(self.options, self.device, self.working is not None),
               "torch_dispatch": dispatcher_name(self.model)}
        if self.sharded is not None:
            out.update(self.sharded.describe())
        elif self.layout is not None:
            out["torch_dense"] = "replicate"
        return out

    def finish(self, first_step: int, steps: int) -> None:
        if self.layout is not None:
            write_summary(self.run_dir, self.model, self.opt, self.layout, first_step=first_step, steps=steps)


def describe_options(options: EngineOptions, device: torch.device, master: bool) -> dict:
    """The options a torch run trains under, as they resolved on its device (status.json and
    the checkpoint info): the GPU kernels or the reference ones, working copies or not, the
    kernels (on a GPU)."""
    fast = fast_path_enabled(device, options)
    return {"device": str(device), "torch_fast": fast, "torch_master": master,
            "torch_kernels": dataclasses.asdict(kernels_for(device, options)) if device.type == "cuda" else None,
            "torch_ep": options.torch_ep, "cpu_threads": options.cpu_threads}


def dispatcher_name(model: MoETransformer) -> str:
    """The token dispatcher the model's experts use (engines/torch/dispatch.py, parallel/dispatch.py)."""
    return type(model.blocks[0].moe.experts.dispatcher).__name__
