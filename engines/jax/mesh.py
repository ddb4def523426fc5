"""The JAX engine on one (data, expert) device mesh.

    mesh = make_mesh_2d(cfg, dp)             # dp x model.ep_size devices, axes ("data", "ep")
    module = mesh_step_module(spec, dp)      # the engine's step module (engines/trainer.py) on it
    Trainer(spec, run_dir, module).fit()

Shardings (NamedSharding; the optimizer moments take their parameter's):
- routed-expert stacks [E, L, F] / [E, F, L]: E over "ep" and their second dimension over "data"
  (FSDP along data where it divides);
- every other parameter: its first dimension that divides by dp over "data" (else replicated);
- the balancing-bias buffers replicated;
- a step's batch: its sequences over ("ep", "data"), so device (d, e) holds part d of source
  shard e, as in engines/torch/parallel/layout.py.
XLA gathers the FSDP shards where the step reads them. The pooled-wave transport is the engine's
shard_map over the "ep" axis (engines/jax/moe.py): within each data row of the mesh it runs on
the row's source shards, gathered over "data" (every data replica runs its row's exchange), so the
drops are the one-device engine's by construction.

Several hosts: initialize_hosts() calls jax.distributed.initialize before anything touches a
device (the coordinator address, process count and id from $JAX_COORDINATOR_ADDRESS,
$JAX_NUM_PROCESSES, $JAX_PROCESS_ID, or what JAX detects itself under SLURM, Kubernetes or Ray's
JaxTrainer); jax.devices() then lists every host's devices and make_mesh_2d lays the mesh over
them in process order (the data axis across hosts, the expert axis within one).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from core.errors import InputError
from core.spec import Spec
from engines.jax.engine import EXPERT_SUFFIXES, JaxStep, configure_jax, state_from_arrays
from engines.jax.model import ModelConfig, init_params
from engines.jax.moe import EP_AXIS, capacities
from engines.jax.train import TrainState, init_state
from engines.options import EngineOptions

DATA_AXIS = "data"


class MeshLayoutError(InputError):
    """A spec that cannot be laid out on the (data, expert) mesh; the message says why."""


def initialize_hosts() -> None:
    """jax.distributed.initialize for a run over several hosts (one process a host); a no-op for
    one process."""
    n = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    if n > 1:
        jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=n,
                                   process_id=int(os.environ["JAX_PROCESS_ID"]))


def make_mesh_2d(cfg: ModelConfig, dp: int) -> Mesh:
    devices = jax.devices()
    need = dp * cfg.ep_size
    if cfg.dispatch != "capacity" or cfg.ep_size < 2:
        raise MeshLayoutError("the (data, expert) mesh runs the pooled-wave transport: it needs "
                              "model.dispatch capacity and model.ep_size > 1")
    if len(devices) < need:
        raise MeshLayoutError(f"a {dp} x {cfg.ep_size} (data x expert) mesh needs {need} devices; "
                              f"JAX sees {len(devices)}")
    return Mesh(np.array(devices[:need]).reshape(dp, cfg.ep_size), (DATA_AXIS, EP_AXIS))


def _spec_of(name: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    dp, ep = mesh.shape[DATA_AXIS], mesh.shape[EP_AXIS]
    if name.endswith(EXPERT_SUFFIXES):
        second = DATA_AXIS if len(shape) > 1 and shape[1] % dp == 0 else None
        return P(EP_AXIS if shape[0] % ep == 0 else None, second)
    for i, s in enumerate(shape):
        if s % dp == 0:
            return P(*([None] * i + [DATA_AXIS]))
    return P()


def place_2d(state: TrainState, mesh: Mesh) -> TrainState:
    """Every parameter and its moments FSDP-sharded along data (experts also over ep); buffers
    and scalars replicated."""

    def put(path, x):
        keys = [getattr(k, "key", None) for k in path]  # dict keys: the parameter's name
        name = next((n for n in reversed(keys) if isinstance(n, str)), None)
        buffer = any(getattr(k, "name", None) == "buffers" for k in path) or (name or "").endswith("router_bias")
        if name is None or buffer or np.ndim(x) == 0:
            return jax.device_put(x, NamedSharding(mesh, P()))
        return jax.device_put(x, NamedSharding(mesh, _spec_of(name, tuple(np.shape(x)), mesh)))

    return jax.tree_util.tree_map_with_path(put, state)


def put_batch_2d(batch_BS1: np.ndarray, mesh: Mesh) -> jax.Array:
    if batch_BS1.shape[0] % mesh.size:
        raise MeshLayoutError(f"a batch of {batch_BS1.shape[0]} sequences does not split over the "
                              f"{mesh.size} devices of the mesh")
    return jax.device_put(batch_BS1, NamedSharding(mesh, P((EP_AXIS, DATA_AXIS))))


class MeshJaxStep(JaxStep):
    """JaxStep with the state FSDP-sharded over the (data, expert) mesh and the batch over both axes."""

    def init_fresh(self) -> None:
        params, buffers = init_params(self.cfg, self.spec.seed)
        self.state = place_2d(init_state(self.cfg, params, buffers, self.tx), self.mesh)

    def load_arrays(self, params: dict, opt: dict, origin: str) -> None:
        self.state = place_2d(state_from_arrays(self.cfg, self.tx, params, opt, origin), self.mesh)

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float):
        self.state, m = self.train_step(self.state, put_batch_2d(batch_BS1, self.mesh), jnp.float32(lr))
        return m

    def eval_losses(self, batches) -> list[float]:
        st = self.state
        # one batch at a time: on the CPU, many collectives in flight can starve XLA's in-process rendezvous
        return [float(self.eval_step(st.params, st.buffers, put_batch_2d(b, self.mesh))) for b in batches]

    def extra(self) -> dict:
        return {"mesh": [self.mesh.shape[DATA_AXIS], self.mesh.shape[EP_AXIS]]}


def mesh_step_module(spec: Spec, dp: int, options: EngineOptions | None = None) -> MeshJaxStep:
    """The JAX engine's step module for `spec` on a dp x model.ep_size mesh of the visible devices."""
    options = options or EngineOptions.for_spec(spec)
    configure_jax()
    cfg = dataclasses.replace(ModelConfig.from_spec(spec.model), kernels=options.jax_kernels)
    if jax.default_backend() == "gpu":
        cfg = dataclasses.replace(cfg, compute_dtype="bfloat16")
    capacities(cfg, spec.data.tokens_per_step)
    return MeshJaxStep(spec, cfg, make_mesh_2d(cfg, dp), options)
