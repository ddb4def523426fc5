"""engines.torch.parallel.train.drive: a rank's exit code, in a one-rank gloo group of this process."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from engines.base import DivergedError
from engines.torch.parallel.train import drive
from ladder.presets import micro_spec


@pytest.fixture
def group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _diverging():
    raise DivergedError("loss is nan at step 3")
    yield  # a generator, as the engine's records are


def _peer_gone():
    raise RuntimeError("[gloo] Connection closed by peer")


def test_a_divergence_exits_3_even_when_a_peer_has_left_before_the_barrier(group, tmp_path, capsys):
    code = drive(micro_spec("m"), tmp_path, _diverging(), lead=True, where="cpu", errors=(ValueError,),
                 barrier=_peer_gone, log_every=1)
    assert code == 3 and not dist.is_initialized()
    err = capsys.readouterr().err
    assert "diverged: loss is nan at step 3" in err and "a peer left before the divergence barrier" in err


def test_a_divergence_with_every_peer_present_exits_3_quietly(group, tmp_path, capsys):
    code = drive(micro_spec("m"), tmp_path, _diverging(), lead=True, where="cpu", errors=(ValueError,),
                 barrier=dist.barrier, log_every=1)
    assert code == 3
    assert capsys.readouterr().err.strip() == "diverged: loss is nan at step 3"
