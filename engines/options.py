"""Engine options: how an engine computes a spec, never what it computes.

An EngineOptions value is what an engine runs under: the engine's defaults with a spec's `options`
section on top (core/options.py: validated literals that an experiment file or a spec's YAML sets,
outside the spec's id), and, where a run starts from the CLI, $MOE_LADDER_OPTIONS on top of that
(read there, once: EngineOptions.resolve(spec.options, Options.from_env())). A bench builds one
directly. It is written into status.json and every checkpoint's state.json, so a run says which
kernels it used.

    torch_fast      1 | 0                                  the CUDA fast path, or the reference forward
    torch_master    1 | 0 (unset: per run)                 bf16 working copies written by the optimizer
    torch_compile   block-cudagraphs | block | dense | none
    torch_ep        auto | emulate | processes             an ep_size > 1 spec in processes or emulated
    jax_mgpu        1 | default | 0                        Mosaic-GPU ragged dots: tuned tiles, one tile, off
    jax_mgpu_tiles  a path                                 a tile file of bench/tune_mgpu.py
    cpu_threads     a count                                torch threads of a CPU run

The torch and JAX kernel choices whose alternatives measured slower (TorchKernels and JaxKernels
below; docs/results/engines-h200.md has the measurements) are set by a spec's options section or a
bench, not by the environment. Where Triton is missing, every Triton choice falls back to its
compiled form (TorchKernels.without_triton).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, get_args

from pydantic import ValidationError

from core.options import (CompileMode, EPLayout, MGPUMode, Options, OptionsError, TorchKernelChoices,  # noqa: F401
                          choices_message)

COMPILE_MODES, EP_LAYOUTS, MGPU_MODES = get_args(CompileMode), get_args(EPLayout), get_args(MGPUMode)


@dataclass(frozen=True)
class TorchKernels:
    """The torch fast path's kernel choices (engines/torch/fast.py); the defaults are what the
    engine uses on a GPU with Triton (docs/results/engines-h200.md has the measurements)."""

    # "block-cudagraphs": blocks and head compiled and replayed as CUDA graphs; "block": the same
    # without graphs; "dense": all but the expert dispatch; "none": eager
    compile: CompileMode = "block-cudagraphs"
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

    def __post_init__(self):
        try:
            TorchKernelChoices.model_validate(dataclasses.asdict(self))
        except ValidationError as err:
            e = err.errors()[0]
            raise OptionsError(f"TorchKernels.{e['loc'][0]}={getattr(self, str(e['loc'][0]))!r}: "
                               f"{choices_message(e)}") from None

    def without_triton(self) -> "TorchKernels":
        """The same choices with every Triton kernel replaced by its compiled form."""
        fallback = {"gather": "inductor", "grouped_dw": "torch", "xent": "inductor", "swiglu": "inductor",
                    "combine_grad": "inductor", "adamw": "compile", "topk": "torch"}
        return dataclasses.replace(self, **{k: v for k, v in fallback.items() if getattr(self, k) == "triton"})


@dataclass(frozen=True)
class JaxKernels:
    """The JAX engine's choices on a GPU (docs/results/engines-h200.md has the measurements); in fp32 on
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
    torch_ep: EPLayout = "auto"
    torch_kernels: TorchKernels = field(default_factory=TorchKernels)
    jax_mgpu: MGPUMode = "1"
    jax_mgpu_tiles: str | None = None
    jax_kernels: JaxKernels = field(default_factory=JaxKernels)
    cpu_threads: int | None = None  # None: one for tiny steps, else torch's own

    def __post_init__(self):
        for name, value, allowed in (("torch_ep", self.torch_ep, EP_LAYOUTS), ("jax_mgpu", self.jax_mgpu, MGPU_MODES),
                                     ("torch_compile", self.torch_kernels.compile, COMPILE_MODES)):
            if value not in allowed:
                raise OptionsError(f"{name}={value!r}: choose one of {', '.join(allowed)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise OptionsError(f"cpu_threads={self.cpu_threads}: must be a count >= 1")

    @classmethod
    def resolve(cls, section: Options, over: Options | None = None) -> "EngineOptions":
        """The defaults with a spec's options section on top, and `over` (the environment's, where
        the CLI read it) on top of that, key by key."""
        given = (section.over(over) if over is not None else section).set_fields()
        torch_kernels = TorchKernels(**given.pop("torch_kernels", {}))
        jax_kernels = JaxKernels(**given.pop("jax_kernels", {}))
        return cls(**given, torch_kernels=torch_kernels, jax_kernels=jax_kernels)

    @classmethod
    def for_spec(cls, spec, over: Options | None = None) -> "EngineOptions":
        """What a spec runs under: its options section (and `over`) on the defaults."""
        return cls.resolve(spec.options, over)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "EngineOptions":
        """The defaults with $MOE_LADDER_OPTIONS on top (Options.from_env says how a bad value is named)."""
        return cls.resolve(Options(), Options.from_env(env))

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
