"""Layout(dp, ep): where a torch run's ranks sit on a (data, expert) device mesh.

world = dp * ep processes, ep = model.ep_size (from the spec: it is part of what the run
computes), dp = world / ep (from the launch: it is not). One device is 1 x 1 (no mesh, the
engine's own step); expert parallel over processes is dp = 1; the one-device engine emulates
the ep shards of a spec inside its dispatcher (engines/torch/dispatch.py). Rank r sits at
(d, e) = divmod(r, ep):
- its expert group is row d, the ep ranks (d, 0..ep-1): the all-to-all runs there, and rank
  (d, e) holds routed experts [e * E/ep, (e+1) * E/ep);
- its data group is column e, the dp ranks (0..dp-1, e): the replicas of expert shard e, over
  which FSDP2 shards those experts;
- the dense parameters are sharded by FSDP2 over all dp * ep ranks (every rank sees other tokens).

Tokens. The step's batch is split into ep contiguous source shards of whole sequences (the
shards the one-device engine emulates), and source shard e into dp contiguous parts: rank (d, e)
holds part d of shard e, and reads only those rows (engines.data.TokenStream.batch with its
part). The transport ranks a source shard's assignments over its dp parts
(engines/torch/parallel/dispatch.py), so drops, losses and gradients do not depend on dp: the
same spec is the same run on any layout.

The launcher follows the layout (engines/torch/parallel/launch.py): in process for 1 x 1,
torchrun on one host, Ray Train across hosts (ladder/train_launch.py).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.spec import ModelSpec

# NVLink multicast stays off, as the machines set it
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class LayoutError(ValueError):
    """A run that cannot be laid out over the ranks; the message says what and how to fix it."""


@dataclass
class Layout:
    dp: int
    ep: int
    rank: int = 0
    device: torch.device | None = None
    mesh: DeviceMesh | None = None  # ("data", "expert")
    flat: DeviceMesh | None = None  # all ranks, one dimension: the dense parameters' FSDP mesh

    @property
    def world(self) -> int:
        return self.dp * self.ep

    @property
    def d(self) -> int:
        return self.rank // self.ep

    @property
    def e(self) -> int:
        return self.rank % self.ep

    @property
    def expert_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("expert")

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("data")

    def experts(self, m: ModelSpec) -> tuple[int, int]:
        """[first, last) routed expert held by this rank."""
        n = m.n_routed_experts // self.ep
        return self.e * n, (self.e + 1) * n

    @property
    def part(self) -> int:
        """This rank's sequences are the part-th of world contiguous, equal parts of a step batch:
        part d of source shard e (with batch_size % world == 0, e * B/ep + d * B/world)."""
        return self.e * self.dp + self.d

    def rows(self, batch_size: int) -> slice:
        """This rank's sequences of a [batch_size, ...] step batch: part d of source shard e."""
        per_rank = batch_size // self.world
        return slice(self.part * per_rank, (self.part + 1) * per_rank)

    def local_batch(self, batch_BS1: np.ndarray) -> np.ndarray:
        return batch_BS1[self.rows(batch_BS1.shape[0])]


def check_layout(m: ModelSpec, world: int, batch_size: int) -> int:
    """dp for `world` processes, or LayoutError naming what does not fit."""
    ep = m.ep_size
    if world % ep:
        raise LayoutError(f"{world} process(es) do not form a (data x expert) mesh with model.ep_size {ep}: "
                          f"start a multiple of {ep}")
    dp = world // ep
    if batch_size % world:
        raise LayoutError(f"data.batch_size ({batch_size}) must be a multiple of the {world} processes "
                          f"(data {dp} x expert {ep}): each rank holds whole sequences")
    if m.n_routed_experts % ep:
        raise LayoutError(f"model.n_routed_experts ({m.n_routed_experts}) must be a multiple of "
                          f"model.ep_size ({ep})")
    return dp


def local_device(device: str | None, local: int) -> torch.device:
    """This process's device: CUDA device `local` (made current) when asked for or available,
    else the CPU; a local rank without a GPU is a LayoutError."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    if torch.cuda.device_count() <= local:
        raise LayoutError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    return dev


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name
        return False


def loopback_store(rank: int, world: int) -> dist.TCPStore | None:
    """The rendezvous store on MASTER_ADDR itself when that is a loopback address (127.0.0.1, ::1).
    torch's TCPStore server listens on every interface ([::]) whatever host it is given; given a
    socket already bound (its master_listen_fd), it listens there. None where another process hosts
    the store (torchrun's agent, TORCHELASTIC_USE_AGENT_STORE) or the address is not a loopback one:
    then init_process_group's own env:// rendezvous runs."""
    addr = os.environ.get("MASTER_ADDR", "")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or not _loopback(addr):
        return None
    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(addr, port, world, False, timeout=default_pg_timeout)
    # the store's server (libuv) takes the descriptor over and closes it: Python lets go of it
    fd = _listen((addr, port)).detach()
    try:
        return dist.TCPStore(addr, port, world, True, timeout=default_pg_timeout, master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise


BIND_TRIES, BIND_WAIT_S = 40, 0.25


def _listen(address: tuple[str, int]) -> socket.socket:
    """A socket listening on `address`. The launcher chose the port free a moment before; another
    process may hold it briefly in between (a probe for a free port binds and closes one), so a
    port in use is tried again for up to BIND_TRIES * BIND_WAIT_S seconds before the error stands."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    for attempt in range(BIND_TRIES):
        try:
            return socket.create_server(address, family=family)
        except OSError as err:
            if err.errno != errno.EADDRINUSE or attempt == BIND_TRIES - 1:
                raise
            time.sleep(BIND_WAIT_S)
    raise AssertionError("unreachable")


def join_process_group(dev: torch.device, rank: int, world: int) -> None:
    """torch.distributed's default group, unless one exists: NCCL on a GPU, else gloo; the
    rendezvous from the launcher's environment (127.0.0.1 and a free port for a single process),
    its store listening on MASTER_ADDR alone when that is a loopback address (loopback_store)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if world == 1:
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    store = loopback_store(rank, world)
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)


def setup_layout(m: ModelSpec, batch_size: int, device: str | None = None) -> Layout:
    """Join the process group the launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT:
    torchrun or Ray Train), gloo on the CPU, NCCL on GPUs, and build the mesh."""
    for var, off in NO_MULTICAST.items():
        os.environ.setdefault(var, off)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_layout(m, world, batch_size)  # before any rendezvous
    dev = local_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    join_process_group(dev, int(os.environ.get("RANK", "0")), world)
    mesh = init_device_mesh(dev.type, (dp, m.ep_size), mesh_dim_names=("data", "expert"))
    return Layout(dp=dp, ep=m.ep_size, rank=dist.get_rank(), device=dev, mesh=mesh, flat=mesh._flatten("data_expert"))
