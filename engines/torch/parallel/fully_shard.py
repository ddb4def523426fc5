"""FSDP2 as a layout's dense sharding of the one step module (engines/torch/step.TorchStep), for
dense state too large to hold whole on every rank (engines/torch/parallel/replicate.dense_sharding
chooses): the rank's sharded model (fsdp.build_sharded_model: the experts over the data group,
the rest over all ranks, gathered in bf16 on a GPU), its share of the objective as the model's
call (so FSDP2's root unit gathers the embedding, final norm and head around it), torch's AdamW on
the fp32 shards, the engine-neutral state in and out of the shards, and the update.

Every rank computes the step's global metrics; a step is read before the next is launched (its
collectives synchronise the ranks anyway), and a non-finite step is not applied (every rank sees
the same global values).
"""

from __future__ import annotations

import numpy as np
import torch

from core.spec import Spec
from engines.options import TorchKernels
from engines.torch.master import build_optimizer
from engines.torch.model import move_router_bias
from engines.torch.parallel.checkpoint import load_moments, optimizer_step
from engines.torch.parallel.fsdp import build_sharded_model, full_arrays, gathers_bf16, grad_norm_and_clip, load_full, reshard
from engines.torch.parallel.layout import Layout, LayoutError
from engines.torch.parallel.model import ShardedLoss, layout_eval_losses, step_metrics
from engines.trainer import FINITE_KEYS, METRIC_KEYS, VALUE_KEYS


class FullyShard:
    """The FSDP2-sharded model, loss and optimizer of a rank of `layout`, and what the step module
    does with them."""

    def __init__(self, spec: Spec, layout: Layout, kernels: TorchKernels):
        if spec.optim.moments != "fp32":  # (MasterAdamW alone keeps bf16 moments: no FSDP2 layout has it)
            raise LayoutError("optim.moments bf16 is not supported under FSDP2: the sharded AdamW keeps fp32 moments")
        self.spec, self.layout = spec, layout
        self.model = build_sharded_model(spec.model, layout)
        self.loss = ShardedLoss(self.model, layout, kernels, hooked=True)
        self.opt = build_optimizer(self.model, spec.optim, sharded=layout.device)

    def load(self, params: dict, moments: dict | None = None) -> None:
        """Engine-neutral arrays (all experts) into this rank's shards."""
        load_full(self.model, params, self.layout)
        if moments is not None:
            load_moments(self.model, self.opt, moments, self.layout)

    def save(self) -> tuple[dict, dict] | None:
        """(params, AdamW arrays) in engine-neutral form on rank 0, None elsewhere (every rank takes
        part in the gathers)."""
        model, opt = self.model, self.opt
        reshard(model)
        params = full_arrays(dict(model.named_parameters()) | dict(model.named_buffers()), self.layout)
        moments = {}
        for name, p in model.named_parameters():
            st = opt.state.get(p) or {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            moments[f"m/{name}"], moments[f"v/{name}"] = st["exp_avg"], st["exp_avg_sq"]
        arrays = full_arrays(moments, self.layout)
        if self.layout.rank != 0:
            return None
        arrays["step"] = np.asarray(optimizer_step(opt), np.int64)
        return params, arrays

    def step(self, x_bS1: torch.Tensor) -> tuple[dict[str, float], bool]:
        """One step on this rank's rows x_bS1 [B / world, S + 1]: (the global metrics, finite)."""
        spec, model, opt, lay, m = self.spec, self.model, self.opt, self.layout, self.spec.model
        n_tok = x_bS1.shape[0] * lay.world * (x_bS1.shape[1] - 1)
        total_r, out = model(x_bS1, spec.optim, n_tok, run=self.loss)
        total_r.backward()
        grad_norm, sums = grad_norm_and_clip(model, spec.optim.grad_clip,
                                             torch.stack([out["aux_r"], out["total_r"]]), lay)
        metrics = step_metrics(out, sums[0], sums[1])
        vals = dict(zip(VALUE_KEYS, torch.stack([metrics[k].float() for k in METRIC_KEYS]
                                                + [grad_norm.float()]).tolist()))
        finite = all(np.isfinite(vals[k]) for k in FINITE_KEYS)
        if finite:
            opt.step()
            if m.router_bias_balancing:
                move_router_bias(model, out["load_LE"], m.router_bias_rate)
        opt.zero_grad(set_to_none=True)
        return vals, finite

    def eval_losses(self, batches) -> list[float]:
        losses = layout_eval_losses(lambda x, n: self.model(x, self.spec.optim, n, run=self.loss), batches, self.layout)
        reshard(self.model)
        return losses

    def describe(self) -> dict:
        """fp32 masters (no working copies: on a GPU FSDP2 gathers the blocks' parameters in bf16)."""
        return {"torch_dense": "fsdp", "torch_gather_dtype": "bf16" if gathers_bf16(self.layout.device) else "fp32"}
