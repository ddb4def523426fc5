"""JaxEngine: trains a spec with the JAX model, writes metrics.jsonl and engine-neutral
checkpoints, resumes exactly from the newest checkpoint.

Nothing in a step is random (no dropout; the data stream is counter-based), so a checkpoint's
parameters, router-bias buffers, AdamW moments and step are the whole training state: a resumed
run replays the same batches and reaches the same weights. Each step's metrics are read after the
next step was launched (engines/lookahead.py), except where an eval, a checkpoint or the end
needs the state at once.

With model.ep_size > 1, capacity dispatch and at least ep_size devices, the routed experts (and
their optimizer moments) are sharded over a device mesh and the pooled-wave all-to-all runs
between devices; the rest of the model is data-parallel over the same devices. Otherwise the
expert shards are emulated on one device, with the same drops.

Precision: fp32 on the CPU with full-precision matmuls (parity with the torch engine); on a GPU
the master weights, their gradients and AdamW state stay fp32 and the matmuls take bf16 inputs
(working copies of the masters, engines/jax/train.py) with fp32 accumulation (routing, norms,
softmaxes and losses in fp32), as the torch engine's MasterAdamW does.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core.spec import OptimSpec, Spec
from engines.base import StepMetrics, emulated_ep_note
from engines.checkpoint import CheckpointError
from engines.jax.fast import load_tiles
from engines.jax.model import ModelConfig, init_params, param_shapes
from engines.jax.moe import EP_AXIS, capacities
from engines.jax.train import TrainState, init_state, make_eval_step, make_optimizer, make_train_step
from engines.options import EngineOptions
from engines.params import is_buffer
from engines.trainer import FINITE_KEYS, Trainer

EXPERT_SUFFIXES = (".moe.experts.w_gate", ".moe.experts.w_up", ".moe.experts.w_down")


def configure_jax() -> None:
    """fp32 everywhere on the CPU, with full-precision matmuls (what parity with torch needs)."""
    jax.config.update("jax_enable_x64", False)
    if jax.default_backend() == "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")


def make_mesh_possible(cfg: ModelConfig, devices: int) -> bool:
    """The pooled-wave transport runs between real devices: capacity dispatch, ep_size > 1 and
    at least ep_size devices."""
    return cfg.ep_size > 1 and cfg.dispatch == "capacity" and devices >= cfg.ep_size


def make_mesh(cfg: ModelConfig) -> Mesh | None:
    """A 1-D mesh over ep_size devices when the pooled-wave transport can run for real."""
    if make_mesh_possible(cfg, len(jax.devices())):
        return Mesh(np.array(jax.devices()[: cfg.ep_size]), (EP_AXIS,))
    return None


def emulation_warning(name: str, cfg: ModelConfig, devices: int, backend: str) -> str | None:
    """What to tell a user whose expert-parallel spec runs on one GPU with the shards emulated."""
    if cfg.ep_size <= 1 or backend != "gpu" or make_mesh_possible(cfg, devices):
        return None
    why = ("dropless dispatch has no device mesh here" if cfg.dispatch != "capacity"
           else f"{devices} GPU(s) visible")
    return emulated_ep_note(name, cfg.ep_size, why, " in capacity mode")


def compiled_steps(cfg: ModelConfig, optim: OptimSpec, bias_rate: float, mesh: Mesh | None):
    """(train_step, eval_step, optimizer) for a model and optimizer, shared by every run in this
    process with the same ones (compiling is most of a small run's time). The peak LR is not part
    of the compiled step (the LR is an argument), so runs that differ only there share it."""
    return _compiled_steps(cfg, optim.model_copy(update={"peak_lr": 1.0}), bias_rate, mesh)


@lru_cache(maxsize=16)
def _compiled_steps(cfg: ModelConfig, optim: OptimSpec, bias_rate: float, mesh: Mesh | None):
    shapes = {k: v for k, v in param_shapes(cfg).items() if not is_buffer(k)}
    tx = make_optimizer(optim, {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()})
    return make_train_step(cfg, optim, tx, bias_rate, mesh), make_eval_step(cfg, optim, mesh), tx


def put_batch(batch_BS1: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """A batch on the device(s): split by sequence over the mesh when the rows divide evenly."""
    if mesh is not None and batch_BS1.shape[0] % mesh.size == 0:
        return jax.device_put(batch_BS1, NamedSharding(mesh, P(EP_AXIS)))
    return jnp.asarray(batch_BS1)


# ---- checkpoint <-> state -------------------------------------------------------------------


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    return next(s for s in opt_state if isinstance(s, optax.ScaleByAdamState))


def state_to_arrays(state: TrainState) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(model tensors by name, {"m/<name>", "v/<name>", "step"}) as numpy for the checkpoint."""
    model = {k: np.asarray(v) for k, v in {**state.params, **state.buffers}.items()}
    adam = _adam_state(state.opt_state)
    opt: dict[str, np.ndarray] = {"step": np.asarray(int(adam.count), np.int64)}
    for k in state.params:
        opt[f"m/{k}"] = np.asarray(adam.mu[k], np.float32)  # (bf16 moments too: checkpoints hold fp32)
        opt[f"v/{k}"] = np.asarray(adam.nu[k], np.float32)
    return model, opt


def state_from_arrays(cfg: ModelConfig, tx: optax.GradientTransformation, model: dict, opt: dict,
                      origin: str) -> TrainState:
    shapes = param_shapes(cfg)
    missing = sorted(set(shapes) - set(model))
    if missing:
        raise CheckpointError(f"{origin}: checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for k, s in shapes.items():
        if tuple(model[k].shape) != s:
            raise CheckpointError(f"{origin}: {k} has shape {tuple(model[k].shape)}, the spec needs {s}")
    params = {k: jnp.asarray(model[k], jnp.float32) for k in shapes if not is_buffer(k)}
    buffers = {k: jnp.asarray(model[k], jnp.float32) for k in shapes if is_buffer(k)}
    opt_state = tx.init(params)
    adam = _adam_state(opt_state)
    new_adam = optax.ScaleByAdamState(
        count=jnp.asarray(int(opt["step"]), jnp.int32),
        mu={k: jnp.asarray(opt.get(f"m/{k}", np.zeros(shapes[k], np.float32)), adam.mu[k].dtype) for k in params},
        nu={k: jnp.asarray(opt.get(f"v/{k}", np.zeros(shapes[k], np.float32)), adam.nu[k].dtype) for k in params},
    )
    opt_state = tuple(new_adam if s is adam else s for s in opt_state)
    return init_state(cfg, params, buffers, tx, opt_state)


def place(state: TrainState, mesh: Mesh | None) -> TrainState:
    """Expert weights and their moments sharded over the mesh along E; the rest replicated."""
    if mesh is None:
        return state
    rep = NamedSharding(mesh, P())
    by_e = NamedSharding(mesh, P(EP_AXIS))

    def put(path, x):
        names = [getattr(k, "key", None) for k in path]
        expert = any(isinstance(n, str) and n.endswith(EXPERT_SUFFIXES) for n in names)
        return jax.device_put(x, by_e if expert else rep)

    return jax.tree_util.tree_map_with_path(put, state)


# ---- the engine -----------------------------------------------------------------------------


class JaxStep:
    """The JAX engine's step module (engines/trainer.py): one process, one device or a mesh."""

    engine = "jax"
    lead = True
    lookahead = True
    synchronous = False  # JAX dispatches asynchronously: a step's time is the time between reads

    def __init__(self, spec: Spec, cfg: ModelConfig, mesh: Mesh | None, options: EngineOptions):
        self.spec, self.cfg, self.mesh, self.options = spec, cfg, mesh, options
        self.devices = mesh.size if mesh is not None else 1
        self.train_step, self.eval_step, self.tx = compiled_steps(cfg, spec.optim, spec.model.router_bias_rate, mesh)
        self.state: TrainState | None = None

    def init_fresh(self) -> None:
        params, buffers = init_params(self.cfg, self.spec.seed)
        self.state = place(init_state(self.cfg, params, buffers, self.tx), self.mesh)

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        self.state = place(state_from_arrays(self.cfg, self.tx, params, opt, origin), self.mesh)

    def save_arrays(self) -> tuple[dict, dict]:
        return state_to_arrays(self.state)

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        # the state goes in donated: the step's output is the only state from here on
        self.state, m = self.train_step(self.state, put_batch(batch_BS1, self.mesh), jnp.float32(lr))
        return m

    def read(self, m) -> tuple[dict[str, float], bool]:
        m = {k: float(v) for k, v in jax.device_get(m).items()}  # the step's one host sync
        return m, all(np.isfinite(m[k]) for k in FINITE_KEYS)

    def eval_losses(self, batches) -> list[float]:
        st = self.state
        # one batch at a time: on the CPU, many collectives in flight can starve XLA's in-process rendezvous
        return [float(self.eval_step(st.params, st.buffers, put_batch(b, self.mesh))) for b in batches]

    def agree(self, value):
        return value

    def extra(self) -> dict:
        return {}

    def describe(self) -> dict:
        o = self.options
        return {"jax_mgpu": o.jax_mgpu, "jax_mgpu_tiles": o.jax_mgpu_tiles,
                "jax_kernels": dataclasses.asdict(self.cfg.kernels), "backend": jax.default_backend(),
                "devices": self.devices}

    def finish(self, first_step: int, steps: int) -> None:
        pass


class JaxEngine:
    name = "jax"

    def __init__(self, options: EngineOptions | None = None):
        self.options = options

    def step_module(self, spec: Spec, options: EngineOptions | None = None) -> JaxStep:
        """The step module of this spec on the devices JAX sees (a mesh where the pooled-wave
        transport can run between them), under `options` (default: the engine's, else the spec's
        options section)."""
        options = options or self.options or EngineOptions.for_spec(spec)
        if options.jax_mgpu_tiles:
            load_tiles(options.jax_mgpu_tiles)  # a bad tile file is named before any work
        configure_jax()
        cfg = dataclasses.replace(ModelConfig.from_spec(spec.model), mgpu=options.jax_mgpu,
                                  mgpu_tiles=options.jax_mgpu_tiles, kernels=options.jax_kernels)
        if jax.default_backend() == "gpu":
            cfg = dataclasses.replace(cfg, compute_dtype="bfloat16")  # fp32 weights, bf16 matmuls
        if cfg.dispatch == "capacity":
            capacities(cfg, spec.data.tokens_per_step)  # T % ep_size: a clear error before any work
        mesh = make_mesh(cfg)
        note = emulation_warning(spec.name, cfg, len(jax.devices()), jax.default_backend())
        if note:
            warnings.warn(note, stacklevel=3)
        return JaxStep(spec, cfg, mesh, options)

    def train(self, spec: Spec, run_dir: str | Path, resume: bool = True) -> Iterator[StepMetrics]:
        # step s + 1 is launched before step s is read (engines/lookahead.py); a non-finite step
        # ends the run at its record, and no state after it is ever saved
        yield from Trainer(spec, run_dir, self.step_module(spec)).fit(resume)
