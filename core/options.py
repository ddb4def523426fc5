"""A spec's `options` section: how an engine computes the spec, never what it computes.

An experiment file or a spec's YAML may set it; every value is a validated literal, and a key it
leaves unset keeps the engine's default (engines/options.py holds the defaults and builds the
EngineOptions value an engine runs under). It is a run argument, outside the spec's id: the same
spec under other options is the same run (the results agree to the kernels' rounding), and the
options a run resolved to are recorded in its status.json and every checkpoint.

    options:
      torch_ep: processes          # an ep_size > 1 spec: auto | emulate | processes
      cpu_threads: 1
      torch_kernels: {compile: none, gather: inductor}
      jax_kernels: {loss: xla}

The environment sets the same keys through one variable, $MOE_LADDER_OPTIONS (core/env.py), read
by the CLI where a run starts (Options.from_env) and laid over the spec's section key by key: the
machine a run lands on knows best how it computes (torch_ep, cpu_threads, jax_mgpu_tiles).

    torch_fast      true | false                   the CUDA fast path, or the reference forward
    torch_master    true | false (unset: per run)  bf16 working copies written by the optimizer
    torch_ep        auto | emulate | processes     an ep_size > 1 spec in processes or emulated
    jax_mgpu        "1" | default | "0"            Mosaic-GPU ragged dots: tuned tiles, one tile, off
    jax_mgpu_tiles  a path                         a tile file of bench/tune_mgpu.py
    cpu_threads     a count                        torch threads of a CPU run
    torch_kernels   the torch fast path's kernel choices (TorchKernelChoices below)
    jax_kernels     the JAX step's choices on a GPU (JaxKernelChoices below)

In $MOE_LADDER_OPTIONS flags are 1 or 0, and `torch_compile=MODE` sets torch_kernels.compile (the
other kernel choices are for a spec or a bench to set, measured slower in
docs/results/engines-h200.md).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core import env as environment
from core.errors import InputError

CompileMode = Literal["block-cudagraphs", "block", "dense", "none"]
EPLayout = Literal["auto", "emulate", "processes"]
MGPUMode = Literal["1", "default", "0"]
AttnBackend = Literal["cudnn", "flash", "efficient", "math"]
Triton = Literal["triton", "inductor"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def set_fields(self) -> dict[str, Any]:
        """The keys given a value (the rest keep the engine's defaults)."""
        return self.model_dump(exclude_none=True)


class TorchKernelChoices(_Section):
    """engines/options.TorchKernels: each the kernel a choice names; unset, the engine's default."""

    compile: CompileMode | None = None
    attn_backend: AttnBackend | None = None
    window_attention: Literal["flex", "mask"] | None = None
    causal_attention: Literal["sdpa", "flex"] | None = None
    grouped_mm_weights: Literal["nmajor", "kmajor"] | None = None
    gather: Triton | None = None
    grouped_dw: Literal["triton", "torch"] | None = None
    experts: Literal["grouped", "fused", "fused-gather"] | None = None
    topk: Literal["triton", "torch"] | None = None
    router: Literal["tf32", "fp32"] | None = None
    rope_layout: Literal["bshq", "bhsq"] | None = None
    xent: Triton | None = None
    swiglu: Triton | None = None
    combine_grad: Triton | None = None
    adamw: Literal["triton", "compile"] | None = None


class JaxKernelChoices(_Section):
    """engines/options.JaxKernels: each the computation a choice names; unset, the engine's default."""

    loss: Literal["fused", "xla"] | None = None
    weights: Literal["working", "cast"] | None = None
    experts: Literal["vjp", "autodiff"] | None = None
    gates: Literal["pick", "gather"] | None = None


class Options(_Section):
    torch_fast: bool | None = None
    torch_master: bool | None = None
    torch_ep: EPLayout | None = None
    torch_kernels: TorchKernelChoices = TorchKernelChoices()
    jax_mgpu: MGPUMode | None = None
    jax_mgpu_tiles: str | None = None
    jax_kernels: JaxKernelChoices = JaxKernelChoices()
    cpu_threads: int | None = Field(default=None, ge=1)

    @field_validator("jax_mgpu", mode="before")
    @classmethod
    def _mgpu_as_text(cls, v: Any) -> Any:
        """YAML reads `jax_mgpu: 1` as a number: 1 and 0 (never true or false) mean "1" and "0"."""
        return str(v) if type(v) is int and v in (0, 1) else v

    def set_fields(self) -> dict[str, Any]:
        out = super().set_fields()
        for k in ("torch_kernels", "jax_kernels"):
            if not out.get(k):
                out.pop(k, None)
        return out

    def over(self, top: "Options") -> "Options":
        """These options with every key `top` sets taken from `top` (kernel choices key by key)."""
        mine, theirs = self.model_dump(), top.set_fields()
        for k in ("torch_kernels", "jax_kernels"):
            mine[k] = {**mine[k], **theirs.pop(k, {})}
        return Options.model_validate({**mine, **theirs})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The options $MOE_LADDER_OPTIONS sets (key=value settings, flags 1 or 0); a bad key or value
        is an OptionsError naming the variable and the key."""
        name = environment.var("OPTIONS")
        values: dict[str, Any] = {}
        for key, raw in environment.settings("OPTIONS", env).items():
            if key in ("torch_fast", "torch_master"):
                if raw not in ("0", "1"):
                    raise OptionsError(f"{name} {key}={raw!r}: choose 1 or 0")
                values[key] = raw == "1"
            elif key == "cpu_threads":
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise OptionsError(f"{name} cpu_threads={raw!r}: not a count") from None
            elif key == "torch_compile":
                values["torch_kernels"] = {"compile": raw}
            elif key in ("torch_ep", "jax_mgpu", "jax_mgpu_tiles"):
                values[key] = raw
            else:
                raise OptionsError(f"{name} {key}={raw!r}: not an option (choose torch_fast, torch_master, "
                                   "torch_compile, torch_ep, jax_mgpu, jax_mgpu_tiles or cpu_threads)")
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            e = err.errors()[0]
            key = "torch_compile" if e["loc"][:1] == ("torch_kernels",) else str(e["loc"][0])
            raw = environment.settings("OPTIONS", env)[key]
            raise OptionsError(f"{name} {key}={raw!r}: {choices_message(e)}") from None


class OptionsError(InputError):
    """An option with a value it does not take; the message names the option."""


def choices_message(e: Mapping[str, Any]) -> str:
    """One pydantic error as a short reason ("choose one of a, b")."""
    expected = e.get("ctx", {}).get("expected")
    if expected:
        return f"choose one of {expected.replace(chr(39), '')}"
    return str(e["msg"]).removeprefix("Value error, ")
