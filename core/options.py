"""Engine options: how an engine computes a spec, never what it computes. The one declaration of
them, read by everything that reads or checks one.

TorchKernels, JaxKernels and EngineOptions below declare each option once: its name, the values it
takes (its type), its default, and whether $MOE_LADDER_OPTIONS sets it. Three things are derived
from that declaration, none written out again:

- the check of a value (TorchKernels(gather="fastest") is an OptionsError naming the field);
- a spec's `options` section (Options, TorchKernelChoices, JaxKernelChoices: every key of the
  declaration, unset by default), which an experiment file or a spec's YAML fills in;
- the environment's overlay (Options.from_env): the keys $MOE_LADDER_OPTIONS takes (ENV_KEYS), each
  converted by its declared type (a flag 1 or 0, a count, a choice) and checked as above.

    options:
      torch_ep: processes          # an ep_size > 1 spec: auto | emulate | processes
      cpu_threads: 1
      torch_kernels: {compile: none, gather: inductor}
      jax_kernels: {loss: xla}

An EngineOptions value is what an engine runs under (engines/options.py names it for the engines):
the defaults with a spec's section on top, and, where a run starts from the CLI, $MOE_LADDER_OPTIONS
on top of that (read there, once: EngineOptions.resolve(spec.options, Options.from_env())). A bench
builds one directly. The options are run arguments, outside the spec's id: the same spec under
other options is the same run (the results agree to the kernels' rounding), and the options a run
resolved to are recorded in its status.json and every checkpoint's state.json.

    torch_fast      1 | 0                                  the GPU kernels, or the reference ones (TorchKernels.reference)
    torch_master    1 | 0 (unset: per run)                 bf16 working copies written by the optimizer
    torch_compile   block-cudagraphs | block | dense | none  (TorchKernels.compile)
    torch_ep        auto | emulate | processes             an ep_size > 1 spec in processes or emulated
    torch_dense     auto | replicate | fsdp                a layout's dense parameters (replicate.dense_sharding)
    jax_mgpu        1 | default | 0                        Mosaic-GPU ragged dots: tuned tiles, one tile, off
    jax_mgpu_tiles  a path                                 a tile file of bench/tune_mgpu.py
    cpu_threads     a count                                torch threads of a CPU run

These are the keys of $MOE_LADDER_OPTIONS (flags 1 or 0). The other kernel choices, whose
alternatives measured slower (docs/results/engines-h200.md), are for a spec or a bench to set.
Where Triton is missing, every Triton choice falls back to its compiled form
(TorchKernels.without_triton).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args, get_origin, get_type_hints

from annotated_types import Ge
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model, field_validator

from core import env as environment
from core.errors import InputError

CompileMode = Literal["block-cudagraphs", "block", "dense", "none"]
EPLayout = Literal["auto", "emulate", "processes"]
DenseSharding = Literal["auto", "replicate", "fsdp"]
MGPUMode = Literal["1", "default", "0"]
AttnBackend = Literal["cudnn", "flash", "efficient", "math"]
Triton = Literal["triton", "inductor"]
Count = Annotated[int, Ge(1)]


class OptionsError(InputError):
    """An option with a value it does not take; the message names the option."""


def choices_message(e: Mapping[str, Any]) -> str:
    """One pydantic error as a short reason ("choose one of a, b")."""
    expected = e.get("ctx", {}).get("expected")
    if expected:
        return f"choose one of {expected.replace(chr(39), '')}"
    if e.get("type") == "greater_than_equal":
        return f"must be a count >= {e['ctx']['ge']}"
    return str(e["msg"]).removeprefix("Value error, ")


def env_key(default: Any, key: str | None = None) -> Any:
    """A field $MOE_LADDER_OPTIONS sets, under `key` (default: the field's own name)."""
    return field(default=default, metadata={"env": key})


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


@lru_cache(maxsize=None)
def _adapter(cls: type, name: str) -> TypeAdapter:
    return TypeAdapter(_hints(cls)[name], config=ConfigDict(strict=True))


def _check(obj: Any, label: str) -> None:
    """Each field of a declaration against its declared type (a nested declaration checks itself)."""
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), _hints(type(obj))[f.name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, hint):
                raise OptionsError(f"{label}{f.name}={value!r}: expected {hint.__name__}(...)")
            continue
        try:
            _adapter(type(obj), f.name).validate_python(value)
        except ValidationError as err:
            e = err.errors()[0]
            raise OptionsError(f"{label}{f.name}={value!r}: {choices_message(e)}") from None


@dataclass(frozen=True)
class TorchKernels:
    """The torch forward's kernel choices (engines/torch/forward.py); the defaults are what the
    engine uses on a GPU with Triton (docs/results/engines-h200.md has the measurements)."""

    # "block-cudagraphs": blocks and head compiled and replayed as CUDA graphs; "block": the same
    # without graphs; "dense": all but the expert dispatch; "none": eager
    compile: CompileMode = env_key("block-cudagraphs", "torch_compile")
    # SDPA kernels in order of preference ("cudnn": cuDNN, then flash, efficient, math); None: SDPA's own
    attn_backend: Optional[AttnBackend] = "cudnn"
    # a sliding window on a GPU: "flex" (FlexAttention with a block mask, skipping the blocks
    # outside the window) or "mask" (SDPA with a dense [S, S] bool mask)
    window_attention: Literal["flex", "mask"] = "flex"
    # plain causal attention on a GPU: "sdpa" (is_causal through attn_backend's kernels) or "flex"
    causal_attention: Literal["sdpa", "flex"] = "sdpa"
    # weights as _grouped_mm reads them: "nmajor" [E, K, N] as stored, or "kmajor" (a transposed copy)
    grouped_mm_weights: Literal["nmajor", "kmajor"] = "nmajor"
    # dropless combine and dispatch backward: "triton" (engines/torch/kernels/gather.py) or "inductor"
    gather: Triton = "triton"
    # expert matmuls' weight gradient: "triton" (engines/torch/kernels/grouped_dw.py) or "torch" (_grouped_mm's)
    grouped_dw: Literal["triton", "torch"] = "triton"
    # the experts' SwiGLU: "grouped", "fused" (in the matmul epilogues, engines/torch/kernels/swiglu_gemm.py)
    # or "fused-gather" (the dispatch's row gather fused too)
    experts: Literal["grouped", "fused", "fused-gather"] = "grouped"
    # the router's top-k: "triton" (engines/torch/kernels/topk.py) or "torch" (torch.topk)
    topk: Literal["triton", "torch"] = "triton"
    # the router's logits matmul: "tf32" (tensor cores, engines/torch/kernels/tf32.py) or "fp32"
    router: Literal["tf32", "fp32"] = "tf32"
    # where RoPE runs: "bshq" (the projection's own layout) or "bhsq" (transposed as SDPA reads it)
    rope_layout: Literal["bshq", "bhsq"] = "bshq"
    # the output head's losses: "triton" (engines/torch/kernels/xent.py) or "inductor"
    xent: Triton = "triton"
    # the experts' SwiGLU backward: "triton" (engines/torch/kernels/swiglu.py) or "inductor"
    swiglu: Triton = "triton"
    # with gather "triton", the combine's backward for the sorted rows: "triton" or "inductor"
    combine_grad: Triton = "triton"
    # MasterAdamW's update: "triton" (engines/torch/kernels/adamw_kernel.py) or "compile" (Inductor)
    adamw: Literal["triton", "compile"] = "triton"

    def __post_init__(self):
        _check(self, "TorchKernels.")

    @classmethod
    def reference(cls) -> "TorchKernels":
        """Plain torch everywhere: eager, SDPA's own backend choice, a dense mask for a window,
        the fp32 router matmul and torch.topk, no Triton kernel (options torch_fast=0)."""
        return cls(compile="none", attn_backend=None, window_attention="mask", causal_attention="sdpa",
                   grouped_mm_weights="nmajor", gather="inductor", grouped_dw="torch", experts="grouped",
                   topk="torch", router="fp32", rope_layout="bhsq", xent="inductor", swiglu="inductor",
                   combine_grad="inductor", adamw="compile")

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
    loss: Literal["fused", "xla"] = "fused"
    # the matmuls' weights: "working" (bf16 copies the optimizer writes beside the fp32 masters)
    # or "cast" (each matmul casts its fp32 master in every step)
    weights: Literal["working", "cast"] = "working"
    # dropless experts' SwiGLU and gated combine: "vjp" (custom VJPs keeping the 16-bit expert
    # products as residuals, engines/jax/fast.py) or "autodiff" (fp32 upcasts stored for the backward)
    experts: Literal["vjp", "autodiff"] = "vjp"
    # the router's gates of the chosen experts: "pick" (a masked sum over a one-hot, whose
    # gradient is elementwise, engines/jax/moe.py) or "gather" (take_along_axis, whose gradient
    # is a scatter-add with atomics)
    gates: Literal["pick", "gather"] = "pick"

    def __post_init__(self):
        _check(self, "JaxKernels.")


@dataclass(frozen=True)
class EngineOptions:
    torch_fast: bool = env_key(True)
    torch_master: Optional[bool] = env_key(None)  # None: decided per run (engines/torch/forward.working_copies_enabled)
    torch_ep: EPLayout = env_key("auto")
    # a layout's dense parameters: "replicate" (whole on every rank, the one-device step on each),
    # "fsdp" (sharded by FSDP2) or "auto" (replicate on a GPU where the rank's state fits:
    # engines/torch/parallel/replicate.dense_sharding)
    torch_dense: DenseSharding = env_key("auto")
    torch_kernels: TorchKernels = field(default_factory=TorchKernels)
    jax_mgpu: MGPUMode = env_key("1")
    jax_mgpu_tiles: Optional[str] = env_key(None)
    jax_kernels: JaxKernels = field(default_factory=JaxKernels)
    cpu_threads: Optional[Count] = env_key(None)  # None: one for tiny steps, else torch's own

    def __post_init__(self):
        _check(self, "")

    @classmethod
    def resolve(cls, section: "Options", over: "Options | None" = None) -> "EngineOptions":
        """The defaults with a spec's options section on top, and `over` (the environment's, where
        the CLI read it) on top of that, key by key."""
        given = (section.over(over) if over is not None else section).set_fields()
        return cls.from_dict(given)

    @classmethod
    def for_spec(cls, spec, over: "Options | None" = None) -> "EngineOptions":
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
        for name, kind in _nested(cls).items():
            d[name] = kind(**d.get(name, {}))
        return cls(**d)


def _nested(cls: type) -> dict[str, type]:
    """{field: its declaration} for the fields of `cls` that are declarations themselves."""
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


# ---- a spec's options section: every key of the declaration, unset (None) by default ----------


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def set_fields(self) -> dict[str, Any]:
        """The keys given a value (the rest keep the engine's defaults)."""
        return self.model_dump(exclude_none=True)


class _OptionsSection(_Section):
    def set_fields(self) -> dict[str, Any]:
        out = super().set_fields()
        for k in _nested(EngineOptions):
            if not out.get(k):
                out.pop(k, None)
        return out

    @field_validator("jax_mgpu", mode="before", check_fields=False)
    @classmethod
    def _mgpu_as_text(cls, v: Any) -> Any:
        """YAML reads `jax_mgpu: 1` as a number: 1 and 0 (never true or false) mean "1" and "0"."""
        return str(v) if type(v) is int and v in (0, 1) else v

    def over(self, top: "Options") -> "Options":
        """These options with every key `top` sets taken from `top` (kernel choices key by key)."""
        mine, theirs = self.model_dump(), top.set_fields()
        for k in _nested(EngineOptions):
            mine[k] = {**mine[k], **theirs.pop(k, {})}
        return Options.model_validate({**mine, **theirs})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The options $MOE_LADDER_OPTIONS sets (ENV_KEYS, each converted by its declared type: a flag
        1 or 0, a count, else the text); a bad key or value is an OptionsError naming the variable and
        the key."""
        name = environment.var("OPTIONS")
        raw = environment.settings("OPTIONS", env)
        values: dict[str, Any] = {}
        for key, text in raw.items():
            if key not in ENV_KEYS:
                raise OptionsError(f"{name} {key}={text!r}: not an option (choose {_or(ENV_KEYS)})")
            where, kind = ENV_KEYS[key]
            if kind is bool:
                if text not in ("0", "1"):
                    raise OptionsError(f"{name} {key}={text!r}: choose 1 or 0")
                value: Any = text == "1"
            elif kind is int:
                try:
                    value = int(text)
                except ValueError:
                    raise OptionsError(f"{name} {key}={text!r}: not a count") from None
            else:
                value = text
            node = values
            for part in where[:-1]:
                node = node.setdefault(part, {})
            node[where[-1]] = value
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            e = err.errors()[0]
            # every value came from a key of ENV_KEYS: the one whose place the error's location names
            key = next(k for k in raw if ENV_KEYS[k][0] == tuple(e["loc"][:len(ENV_KEYS[k][0])]))
            raise OptionsError(f"{name} {key}={raw[key]!r}: {choices_message(e)}") from None


def _or(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def _choices(cls: type, name: str, base: type, doc: str, **nested: type) -> type:
    """The section model of a declaration: each field its declared type or None (unset), a nested
    declaration its own section."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            fields[f.name] = (nested[f.name], nested[f.name]())
        else:
            fields[f.name] = (Optional[_hints(cls)[f.name]], None)
    return create_model(name, __base__=base, __doc__=doc, __module__=__name__, **fields)


TorchKernelChoices = _choices(TorchKernels, "TorchKernelChoices", _Section,
                              "TorchKernels' fields, each the kernel a choice names; unset, the engine's default.")
JaxKernelChoices = _choices(JaxKernels, "JaxKernelChoices", _Section,
                            "JaxKernels' fields, each the computation a choice names; unset, the engine's default.")
Options = _choices(EngineOptions, "Options", _OptionsSection,
                   "A spec's options section: EngineOptions' fields, each unset (the engine's default) unless given.",
                   torch_kernels=TorchKernelChoices, jax_kernels=JaxKernelChoices)


def _env_keys() -> dict[str, tuple[tuple[str, ...], type]]:
    """{key of $MOE_LADDER_OPTIONS: (where it goes in the section, bool | int | str)}, from the fields
    the declaration marks with env_key, in its order."""
    def kind(hint: Any) -> type:
        while get_origin(hint) in (Annotated, Union):
            hint = next(a for a in get_args(hint) if a is not type(None))
        return hint if hint in (bool, int) else str

    out: dict[str, tuple[tuple[str, ...], type]] = {}
    for f in dataclasses.fields(EngineOptions):
        inner = _nested(EngineOptions).get(f.name)
        for g, path in ([(h, (f.name, h.name)) for h in dataclasses.fields(inner)] if inner else [(f, (f.name,))]):
            if "env" in g.metadata:
                out[g.metadata["env"] or g.name] = (path, kind(_hints(inner or EngineOptions)[g.name]))
    return out


ENV_KEYS = _env_keys()
