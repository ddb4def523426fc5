"""Pre-flight: refuse, before anything starts, a spec whose memory estimate (core.costs) exceeds
its hardware's memory per device. The estimate is a lower bound of what the engines use (one
sequence per micro-batch, activation checkpointing), so a refused spec cannot fit."""

from __future__ import annotations

from core import costs
from core.spec import Spec
from ladder.errors import LadderError


def memory_problem(spec: Spec) -> str | None:
    """None when the spec fits its hardware.hbm_gb per device, else a line with the estimate."""
    mem = costs.memory_per_gpu(spec)
    if mem["fits"]:
        return None
    hw = spec.hardware
    return (f"spec {spec.name} needs an estimated {_gb(mem['total'])} GB per device (weights, gradients and "
            f"optimizer state {_gb(mem['weights_grads_optimizer'])} GB, activations {_gb(mem['activations'])} GB) "
            f"but hardware.hbm_gb is {hw.hbm_gb:g} GB on {max(hw.n_gpus, 1)} device(s): shard it over more devices "
            f"(hardware.n_gpus, hardware.ep_domain) or make the model smaller")


def _gb(n_bytes: float) -> str:
    gb = n_bytes / 2**30
    return f"{gb:,.1f}" if gb >= 10 else f"{gb:.3g}"


def check_memory(specs: list[Spec]) -> None:
    """LadderError naming every spec that cannot fit (one line)."""
    problems = [p for p in (memory_problem(s) for s in specs) if p]
    if problems:
        raise LadderError("refused: " + " | ".join(problems))
