"""The engine contract.

    train(spec, run_dir, resume=True) -> Iterator[StepMetrics]

An engine owns its checkpoints in run_dir and resumes from the newest one exactly (same data
order, same RNG). Every StepMetrics is appended to run_dir/metrics.jsonl and flushed as it is made,
so the run dir is the source of truth. Engines import neither Ray nor MLflow.

Parameter names are engine-neutral (both engines read and write the same safetensors files):

    embed.weight                      [V, D]
    blocks.{i}.attn_norm.weight       [D]
    blocks.{i}.attn.wq                [D, H*Dh]      (x @ w layout: input dim first)
    blocks.{i}.attn.wk                [D, KV*Dh]
    blocks.{i}.attn.wv                [D, KV*Dh]
    blocks.{i}.attn.wo                [H*Dh, D]
    blocks.{i}.moe_norm.weight        [D]
    blocks.{i}.moe.router             [D, E]
    blocks.{i}.moe.router_bias        [E]            (balancing bias; a buffer, not trained)
    blocks.{i}.moe.latent_down        [D, Dl]        (only with a latent)
    blocks.{i}.moe.latent_up          [Dl, D]
    blocks.{i}.moe.experts.w_gate     [E, Dl, F]
    blocks.{i}.moe.experts.w_up       [E, Dl, F]
    blocks.{i}.moe.experts.w_down     [E, F, Dl]
    blocks.{i}.moe.shared.w_gate      [S, D, Fs]     (only with shared experts)
    blocks.{i}.moe.shared.w_up        [S, D, Fs]
    blocks.{i}.moe.shared.w_down      [S, Fs, D]
    final_norm.weight                 [D]
    lm_head                           [D, V]
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

from core.rundir import METRICS_FILE, STATUS_FILE, MetricsWriter, RunDir  # noqa: F401 (engines' public names)
from core.spec import Spec


@dataclass
class StepMetrics:
    step: int
    tokens: int
    loss: float
    grad_norm: float  # before clipping
    lr: float
    z_loss: float = 0.0
    aux_loss: float = 0.0
    drop_frac_send: float = 0.0  # share of expert assignments dropped at the sender pool
    drop_frac_recv: float = 0.0  # share dropped at the receiver's per-expert bound
    expert_load_max: float = 0.0  # max over experts of assignments / mean assignments
    router_entropy: float = 0.0  # mean per-token entropy of router probabilities (nats)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    eval_loss: float | None = None
    time: float = 0.0  # unix time the step finished
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        if not d["extra"]:
            d.pop("extra")
        return json.dumps(d, allow_nan=True)

    @classmethod
    def from_dict(cls, d: dict) -> "StepMetrics":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


class DivergedError(RuntimeError):
    """The loss became NaN or inf; nothing after the newest checkpoint was saved (the message names
    that checkpoint and how it is known good)."""


@runtime_checkable
class Engine(Protocol):
    name: str

    def train(self, spec: Spec, run_dir: str | Path, resume: bool = True) -> Iterator[StepMetrics]: ...


def emulated_ep_note(name: str, ep: int, why: str, needs: str = "") -> str:
    """The warning both engines give an expert-parallel spec that runs on one GPU with its shards
    emulated (`needs`: what else the run must have for real expert parallelism)."""
    return (f"{name}: model.ep_size {ep} runs on one GPU with its {ep} expert shards emulated ({why}); "
            f"give the run {ep} GPUs (hardware.task_gpus {ep} under Ray){needs} to split the experts over them")


def truncate_metrics(path: Path, keep_below_step: int) -> None:
    """Keep only complete records with step < keep_below_step (see core.rundir)."""
    RunDir(Path(path).parent).truncate_metrics(keep_below_step)


def read_metrics(run_dir: str | Path) -> list[dict]:
    return RunDir(run_dir).read_metrics()


def write_status(run_dir: str | Path, state: str, **info) -> None:
    """state: running | finished | diverged | failed."""
    RunDir(run_dir).write_status(state, **info)


def read_status(run_dir: str | Path) -> dict:
    return RunDir(run_dir).read_status()
