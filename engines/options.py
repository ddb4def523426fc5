"""Engine options: how an engine computes a spec, never what it computes.

An EngineOptions value is built once (EngineOptions.from_env, or by a caller such as a bench),
passed to the engine, and written into status.json and every checkpoint's state.json, so a run
says which kernels it used. It never enters a spec's identity: the same spec under other options
is the same run (the results agree to the kernels' rounding).

Switches read from the environment (the README's switch table):

    MOE_LADDER_TORCH_FAST      1 | 0                          the CUDA fast path, or the reference forward
    MOE_LADDER_TORCH_MASTER    (unset) | 1 | 0                bf16 working copies written by the optimizer
    MOE_LADDER_TORCH_COMPILE   block-cudagraphs | block | dense | none
    MOE_LADDER_TORCH_EP        auto | emulate | processes     an ep_size > 1 spec in processes or emulated
    MOE_LADDER_JAX_MGPU        1 | default | 0                Mosaic-GPU ragged dots: tuned tiles, one tile, off
    MOE_LADDER_JAX_MGPU_TILES  a path                         a tile file of bench/tune_mgpu.py
    MOE_LADDER_CPU_THREADS     a count                        torch threads of a CPU run

The torch and JAX kernel choices whose alternatives measured slower (TorchKernels and JaxKernels
below; bench/RESULTS_h200.md has each measurement) are fields only: a bench builds EngineOptions
with them to compare, nothing reads them from the environment. Where Triton is missing, every
Triton choice falls back to its compiled form (TorchKernels.without_triton).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Mapping

COMPILE_MODES = ("block-cudagraphs", "block", "dense", "none")
EP_LAYOUTS = ("auto", "emulate", "processes")
MGPU_MODES = ("1", "default", "0")


class OptionsError(ValueError):
    """A switch with a value it does not take; the message names the switch."""


@dataclass(frozen=True)
class TorchKernels:
    """The torch fast path's kernel choices (engines/torch/fast.py); the defaults are what the
    engine uses on a GPU with Triton (bench/RESULTS_h200.md has each measurement)."""

    # "block-cudagraphs": blocks and head compiled and replayed as CUDA graphs; "block": the same
    # without graphs; "dense": all but the expert dispatch; "none": eager
    compile: str = "block-cudagraphs"
    # SDPA kernels in order of preference ("cudnn": cuDNN, then flash, efficient, math); None: SDPA's own
    attn_backend: str | None = "cudnn"
    # a sliding window on a GPU: "flex" (FlexAttention with a block mask, skipping the blocks
    # outside the window) or "mask" (SDPA with a dense [S, S] bool mask)
    window_attention: str = "flex"
    # plain causal attention on a GPU: "sdpa" (is_causal through attn_backend's kernels) or "flex"
    causal_attention: str = "sdpa"
    # weights as _grouped_mm reads them: "nmajor" [E, K, N] as stored, or "kmajor" (a transposed copy)
    grouped_mm_weights: str = "nmajor"
    # dropless combine and dispatch backward: "triton" (engines/torch/kernels/gather.py) or "inductor"
    gather: str = "triton"
    # expert matmuls' weight gradient: "triton" (engines/torch/kernels/grouped_dw.py) or "torch" (_grouped_mm's)
    grouped_dw: str = "triton"
    # the experts' SwiGLU: "grouped", "fused" (in the matmul epilogues, engines/torch/kernels/swiglu_gemm.py)
    # or "fused-gather" (the dispatch's row gather fused too)
    experts: str = "grouped"
    # the router's top-k: "triton" (engines/torch/kernels/topk.py) or "torch" (torch.topk)
    topk: str = "triton"
    # the router's logits matmul: "tf32" (tensor cores, engines/torch/kernels/tf32.py) or "fp32"
    router: str = "tf32"
    # where RoPE runs: "bshq" (the projection's own layout) or "bhsq" (transposed as SDPA reads it)
    rope_layout: str = "bshq"
    # the output head's losses: "triton" (engines/torch/kernels/xent.py) or "inductor"
    xent: str = "triton"
    # the experts' SwiGLU backward: "triton" (engines/torch/kernels/swiglu.py) or "inductor"
    swiglu: str = "triton"
    # with gather "triton", the combine's backward for the sorted rows: "triton" or "inductor"
    combine_grad: str = "triton"
    # MasterAdamW's update: "triton" (engines/torch/kernels/adamw_kernel.py) or "compile" (Inductor)
    adamw: str = "triton"

    def without_triton(self) -> "TorchKernels":
        """The same choices with every Triton kernel replaced by its compiled form."""
        fallback = {"gather": "inductor", "grouped_dw": "torch", "xent": "inductor", "swiglu": "inductor",
                    "combine_grad": "inductor", "adamw": "compile", "topk": "torch"}
        return dataclasses.replace(self, **{k: v for k, v in fallback.items() if getattr(self, k) == "triton"})


@dataclass(frozen=True)
class JaxKernels:
    """The JAX engine's choices on a GPU (bench/RESULTS_h200.md has each measurement); in fp32 on
    the CPU none changes the arithmetic beyond rounding."""

    # the output head's losses: "fused" (a custom VJP over the 16-bit logits, engines/jax/loss.py)
    # or "xla" (autodiff over the logits upcast to fp32)
    loss: str = "fused"
    # the matmuls' weights: "working" (bf16 copies the optimizer writes beside the fp32 masters)
    # or "cast" (each matmul casts its fp32 master in every step)
    weights: str = "working"
    # dropless experts' SwiGLU and gated combine: "vjp" (custom VJPs keeping the 16-bit expert
    # products as residuals, engines/jax/fast.py) or "autodiff" (fp32 upcasts stored for the backward)
    experts: str = "vjp"
    # the router's gates of the chosen experts: "pick" (a masked sum over a one-hot, whose
    # gradient is elementwise, engines/jax/moe.py) or "gather" (take_along_axis, whose gradient
    # is a scatter-add with atomics)
    gates: str = "pick"

    def __post_init__(self):
        for name, allowed in (("loss", ("fused", "xla")), ("weights", ("working", "cast")),
                              ("experts", ("vjp", "autodiff")), ("gates", ("pick", "gather"))):
            if getattr(self, name) not in allowed:
                raise OptionsError(f"JaxKernels.{name}={getattr(self, name)!r}: choose {' or '.join(allowed)}")


@dataclass(frozen=True)
class EngineOptions:
    torch_fast: bool = True
    torch_master: bool | None = None  # None: decided per run (engines/torch/fast.working_copies_enabled)
    torch_ep: str = "auto"
    torch_kernels: TorchKernels = field(default_factory=TorchKernels)
    jax_mgpu: str = "1"
    jax_mgpu_tiles: str | None = None
    jax_kernels: JaxKernels = field(default_factory=JaxKernels)
    cpu_threads: int | None = None  # None: one for tiny steps, else torch's own

    def __post_init__(self):
        if self.torch_ep not in EP_LAYOUTS:
            raise OptionsError(f"MOE_LADDER_TORCH_EP={self.torch_ep!r}: choose one of {', '.join(EP_LAYOUTS)}")
        if self.jax_mgpu not in MGPU_MODES:
            raise OptionsError(f"MOE_LADDER_JAX_MGPU={self.jax_mgpu!r}: choose one of {', '.join(MGPU_MODES)}")
        if self.torch_kernels.compile not in COMPILE_MODES:
            raise OptionsError(f"MOE_LADDER_TORCH_COMPILE={self.torch_kernels.compile!r}: "
                               f"choose one of {', '.join(COMPILE_MODES)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise OptionsError(f"MOE_LADDER_CPU_THREADS={self.cpu_threads}: must be a count >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "EngineOptions":
        """The options the environment's switches choose (unset ones keep their defaults); a bad
        value is an OptionsError naming the switch."""
        env = os.environ if env is None else env

        def flag(name: str, default: bool | None) -> bool | None:
            raw = env.get(name, "")
            if raw == "":
                return default
            if raw not in ("0", "1"):
                raise OptionsError(f"{name}={raw!r}: choose 1 or 0")
            return raw == "1"

        threads = env.get("MOE_LADDER_CPU_THREADS", "")
        try:
            cpu_threads = int(threads) if threads else None
        except ValueError:
            raise OptionsError(f"MOE_LADDER_CPU_THREADS={threads!r}: not a count") from None
        kernels = TorchKernels(compile=env.get("MOE_LADDER_TORCH_COMPILE") or TorchKernels.compile)
        return cls(
            torch_fast=flag("MOE_LADDER_TORCH_FAST", True),
            torch_master=flag("MOE_LADDER_TORCH_MASTER", None),
            torch_ep=env.get("MOE_LADDER_TORCH_EP") or "auto",
            torch_kernels=kernels,
            jax_mgpu=env.get("MOE_LADDER_JAX_MGPU") or "1",
            jax_mgpu_tiles=env.get("MOE_LADDER_JAX_MGPU_TILES") or None,
            cpu_threads=cpu_threads,
        )

    def replace(self, **changes) -> "EngineOptions":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """JSON-able, for status.json and the checkpoint info."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "EngineOptions":
        d = dict(d)
        d["torch_kernels"] = TorchKernels(**d.get("torch_kernels", {}))
        d["jax_kernels"] = JaxKernels(**d.get("jax_kernels", {}))
        return cls(**d)
