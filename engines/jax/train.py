"""The pure, jit-compiled train and eval steps.

train_step(state, tokens_BS1, lr) -> (state, metrics): the learning rate is an argument (from
core.schedule.lr_at, outside), never an optax schedule of its own, so the one LR function
rules both engines. AdamW is optax's own construction (scale_by_adam, decoupled weight decay on
matrices only, times -lr) after clip_by_global_norm; the grad norm reported is the one before
clipping. The router-bias buffers move by sign balancing after the update, outside the gradient.

Working copies (JaxKernels.weights "working", a 16-bit compute dtype): the state holds each
matmul weight's master rounded to the compute dtype, written by the step beside the update. The
forward reads them as they are and their gradients arrive in that dtype, upcast where the norm
and the optimizer read them: the same values as casting each master inside its matmul (the cast's
own gradient is that upcast), without a cast of every weight in every step.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from engines.jax.loss import head_losses, head_losses_autodiff
from engines.jax.model import ModelConfig, Params, forward
from engines.jax.moe import make_moe_fn
from core.spec import OptimSpec


class TrainState(NamedTuple):
    params: Params  # fp32 masters (a matmul reads a working copy where there is one, else casts its master)
    buffers: Params
    opt_state: optax.OptState
    working: Params  # the matmul weights in the compute dtype (working_copies; empty without them)


def working_names(cfg: ModelConfig, params: Params) -> list[str]:
    """The weights the step keeps working copies of: every matrix a matmul reads in the compute
    dtype (not the embedding, a gather, nor the router, an fp32 matmul); none in fp32 or with
    JaxKernels.weights "cast"."""
    if cfg.dtype == jnp.float32 or cfg.kernels.weights != "working":
        return []
    return [k for k, v in params.items() if v.ndim >= 2 and k != "embed.weight" and not k.endswith(".moe.router")]


def working_copies(cfg: ModelConfig, params: Params) -> Params:
    return {k: params[k].astype(cfg.dtype) for k in working_names(cfg, params)}


def init_state(cfg: ModelConfig, params: Params, buffers: Params, tx: optax.GradientTransformation,
               opt_state: optax.OptState | None = None) -> TrainState:
    """A state of these masters and buffers: fresh optimizer state unless one is given, and the
    working copies of the masters."""
    opt_state = tx.init(params) if opt_state is None else opt_state
    return TrainState(params, buffers, opt_state, working_copies(cfg, params))


def decay_mask(params: Params) -> Params:
    """Weight decay on matrices (and expert stacks) only: never norms, never vectors."""
    return {k: v.ndim >= 2 for k, v in params.items()}


def scale_by_adam_stored_in(dtype, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments stored in `dtype`: read into fp32, updated and
    bias-corrected there (the update uses the unrounded moments), rounded to nearest on the store.
    (scale_by_adam's own mu_dtype rounds the first moment only, and multiplies it by b1 in that dtype.)"""
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)

    def stored(st: optax.ScaleByAdamState, dt) -> optax.ScaleByAdamState:
        return st._replace(mu=optax.tree_utils.tree_cast(st.mu, dt), nu=optax.tree_utils.tree_cast(st.nu, dt))

    def init_fn(params):
        return stored(adam.init(params), dtype)

    def update_fn(updates, state, params=None):
        out, st = adam.update(updates, stored(state, jnp.float32), params)
        return out, stored(st, dtype)

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(optim: OptimSpec, params: Params) -> optax.GradientTransformation:
    """AdamW without its learning rate (applied by the step) and before it, clipping; the moments
    are stored in optim.moments' dtype."""
    if optim.moments == "fp32":
        adam = optax.scale_by_adam(b1=optim.beta1, b2=optim.beta2, eps=optim.eps)
    else:
        adam = scale_by_adam_stored_in(jnp.bfloat16, optim.beta1, optim.beta2, optim.eps)
    return optax.chain(
        optax.clip_by_global_norm(optim.grad_clip),
        adam,
        optax.add_decayed_weights(optim.weight_decay, mask=decay_mask(params)),
    )


def loss_and_stats(params: Params, buffers: Params, tokens_BS1: jax.Array, cfg: ModelConfig,
                   optim: OptimSpec, mesh: Mesh | None):
    """(total loss, (stats, per-layer expert loads)); `params` may hold working copies in place
    of masters."""
    inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    moe_fn = make_moe_fn(cfg, inputs_BS.shape[1], mesh)
    logits_BSV, st = forward(params, buffers, inputs_BS, cfg, moe_fn)
    losses = head_losses if cfg.kernels.loss == "fused" else head_losses_autodiff
    ce, z = losses(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))
    aux = jnp.mean(st["aux"])
    router_z = jnp.mean(st["router_z"])
    total = ce + optim.z_loss * z + optim.aux_loss * aux + optim.router_z_loss * router_z
    load_LE = st["load"]
    stats = {
        "loss": ce,
        "z_loss": z,
        "aux_loss": aux,
        "router_z_loss": router_z,
        "drop_frac_send": jnp.mean(st["drop_send"]),
        "drop_frac_recv": jnp.mean(st["drop_recv"]),
        "expert_load_max": jnp.max(jnp.max(load_LE, axis=-1) / jnp.mean(load_LE, axis=-1)),
        "router_entropy": jnp.mean(st["entropy"]),
    }
    return total, (stats, load_LE)


def balance_biases(buffers: Params, load_LE: jax.Array, rate: float) -> Params:
    """Auxiliary-loss-free balancing: each layer's bias rises for under-loaded experts and falls
    for over-loaded ones by `rate` (sign of the deviation from the mean load)."""
    out = dict(buffers)
    for i in range(load_LE.shape[0]):
        name = f"blocks.{i}.moe.router_bias"
        load_E = load_LE[i]
        out[name] = buffers[name] + rate * jnp.sign(jnp.mean(load_E) - load_E)
    return out


def make_train_step(cfg: ModelConfig, optim: OptimSpec, tx: optax.GradientTransformation,
                    bias_rate: float, mesh: Mesh | None = None):
    grad_fn = jax.value_and_grad(partial(loss_and_stats, cfg=cfg, optim=optim, mesh=mesh), has_aux=True)

    def step(state: TrainState, tokens_BS1: jax.Array, lr: jax.Array):
        weights = {**state.params, **state.working}
        (total, (stats, load_LE)), grads = grad_fn(weights, state.buffers, tokens_BS1)
        grads = {k: g.astype(jnp.float32) for k, g in grads.items()}  # a working copy's arrive 16-bit
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
        buffers = balance_biases(state.buffers, load_LE, bias_rate) if cfg.bias_balancing else state.buffers
        stats = dict(stats, grad_norm=grad_norm, total_loss=total)
        return TrainState(params, buffers, opt_state, working_copies(cfg, params)), stats

    return jax.jit(step, donate_argnums=(0,))


def make_eval_step(cfg: ModelConfig, optim: OptimSpec, mesh: Mesh | None = None):
    def ev(params: Params, buffers: Params, tokens_BS1: jax.Array):
        _, (stats, _) = loss_and_stats(params, buffers, tokens_BS1, cfg, optim, mesh)
        return stats["loss"]

    return jax.jit(ev)
