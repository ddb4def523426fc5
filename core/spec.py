"""Typed experiment specs.

A spec says everything that changes a training result (model, data, optim, schedule, engine,
seed) plus the run arguments that do not (hardware, run settings, name, lineage, and the engine
options of core/options.py: how an engine computes it). Its id hashes only the former, so the same
spec is the same run on any cluster and under any kernels.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, ValidationError, ValidationInfo,
                      field_validator, model_serializer, model_validator)

from core.errors import InputError
from core.fsutil import atomic_write_text
from core.options import Options
from core.safeload import InputLimitError, parse_json, parse_yaml, read_text

# Sections that change the training result; everything else is a run argument.
IDENTITY_FIELDS = ("model", "data", "optim", "schedule", "engine", "seed")
# fields added after spec ids were in use: in the identity only when set off their default, so
# that every earlier spec keeps its id (and its ledger entries)
LATE_FIELDS = {("optim", "moments"): "fp32", ("data", "max_epochs"): 1.0, ("data", "eval_tokens"): 2**20,
               ("data", "eval_seq_len"): None}
# bf16 moments round each update to 8 significant bits: the second moment's step change,
# (1 - beta2) * (g^2 - v), must stay above that rounding (2^-8 of v) for gradients near its mean
BF16_MOMENTS_MAX_BETA2 = 0.99


# a name becomes a path component (run dirs, analysis dirs): letters, digits and . _ + - only,
# starting with a letter or digit, so it can name neither a parent directory nor a subdirectory
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,199}$"


def check_name(name: str, what: str = "name") -> str:
    """name if it is a safe path component (NAME_PATTERN), else ValueError saying why."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"{what} {name!r} is not a safe name: use 1-200 letters, digits, '.', '_', '+' or '-', "
                         "starting with a letter or digit (it becomes a directory name)")
    return name


class _Frozen(BaseModel):
    # every float finite (no inf or NaN), and no boolean where a number is due (YAML's `true` is not 1)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            if ann is not bool and bool not in get_args(ann):
                raise ValueError(f"got the boolean {str(v).lower()}, which this field does not take")
        return v


class ModelSpec(_Frozen):
    n_layers: int = Field(gt=0)
    d_model: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    n_routed_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0, default=0)
    expert_hidden: int = Field(gt=0, description="SwiGLU hidden width of one routed expert")
    shared_hidden: int = Field(ge=0, default=0, description="SwiGLU hidden width of one shared expert")
    latent_dim: int | None = Field(
        default=None, gt=0, description="routed experts run inside this latent width (None: d_model)"
    )
    router_kind: Literal["softmax", "sigmoid"] = "softmax"
    router_bias_balancing: bool = Field(
        default=False, description="auxiliary-loss-free balancing: a per-expert bias on selection scores"
    )
    router_bias_rate: float = Field(default=1e-3, ge=0)
    balance_scope: Literal["batch", "sequence"] = "batch"
    dispatch: Literal["dropless", "capacity"] = "dropless"
    capacity_factor_send: float = Field(default=1.25, description="bound on rows one source sends one destination")
    capacity_factor_recv: float = Field(default=1.25, description="bound on rows per local expert")
    n_waves: int = Field(default=1, gt=0)
    ep_size: int = Field(default=1, gt=0, description="expert-parallel shards (emulated on one device)")
    attention_window: int | None = Field(default=None, gt=0, description="sliding window; None = full causal")
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    init_std: float = Field(default=0.02, gt=0)

    @field_validator("capacity_factor_send", "capacity_factor_recv")
    @classmethod
    def _cf_at_least_one(cls, v: float) -> float:
        if not v >= 1.0:
            raise ValueError(f"capacity factor must be >= 1.0 (got {v}); below 1 even a perfectly balanced router drops")
        return v

    @model_validator(mode="after")
    def _shapes(self) -> "ModelSpec":
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds n_routed_experts ({self.n_routed_experts})")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) does not divide d_model ({self.d_model})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) does not divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.n_routed_experts % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) does not divide n_routed_experts ({self.n_routed_experts})")
        if self.latent_dim is not None and self.latent_dim > self.d_model:
            raise ValueError(f"latent_dim ({self.latent_dim}) exceeds d_model ({self.d_model})")
        if self.n_shared_experts > 0 and self.shared_hidden == 0:
            raise ValueError("n_shared_experts > 0 needs shared_hidden > 0")
        return self

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write (the latent when there is one)."""
        return self.latent_dim or self.d_model


class SourceSpec(_Frozen):
    name: str = Field(min_length=1)
    weight: float
    builtin: Literal["python_code", "python_docs", "packages_python", "packages_docs", "packages_native"] | None = Field(
        default=None, description="text every machine has: the Python installation's own source or prose, or "
        "a part of the corpus `ladder data corpus` builds from installed packages (packages_*)"
    )
    paths: tuple[str, ...] = Field(default=(), description="txt / jsonl / parquet files or globs")
    text_key: str = "text"

    @model_validator(mode="after")
    def _one_origin(self) -> "SourceSpec":
        if (self.builtin is None) == (len(self.paths) == 0):
            raise ValueError(f"source {self.name!r}: give exactly one of builtin or paths")
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(f"source {self.name!r}: weight must be finite and >= 0 (got {self.weight})")
        return self


class DataPhase(_Frozen):
    """From `start_frac` of training on, the mixture uses these weights (e.g. a midtrain phase)."""

    name: str
    start_frac: float = Field(ge=0, lt=1)
    weights: dict[str, float]

    @field_validator("weights", mode="before")
    @classmethod
    def _no_bool_weight(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for k, w in v.items():
                if isinstance(w, bool):
                    raise ValueError(f"weight of {k!r} is the boolean {str(w).lower()}, not a number")
        return v


class ContextStage(_Frozen):
    """A longer context from `start_frac` on; `gated` stages wait for a replan to enable them."""

    start_frac: float = Field(ge=0, lt=1)
    seq_len: int = Field(gt=0)
    gated: bool = True
    gate: str = "drop_frac <= 0.07"


class DataSpec(_Frozen):
    sources: tuple[SourceSpec, ...] = Field(min_length=1)
    tokenizer: str = Field(default="bytes", description="bytes, a Hugging Face tokenizer.json path, or a preset "
                           "name (llama3, ...) resolving to a local file (engines.tokenizer)")
    max_epochs: float = Field(default=1.0, gt=0, description="the most passes over any source a run may make")
    seq_len: int = Field(gt=0)
    batch_size: int = Field(gt=0, description="sequences per step")
    total_tokens: int = Field(gt=0)
    phases: tuple[DataPhase, ...] = ()
    context_stages: tuple[ContextStage, ...] = ()
    eval_fraction: float = Field(default=0.01, gt=0, lt=0.5, description="the most of every source its fixed "
                                 "eval set may hold (engines/evalset.py)")
    eval_tokens: int = Field(default=2**20, gt=0, description="tokens of every source's fixed eval set (at most "
                             "eval_fraction of the source, at least two windows); the same for every run")
    eval_seq_len: int | None = Field(default=None, gt=0, description="tokens an eval window predicts (default "
                                     "seq_len); set it when an experiment's runs differ in sequence length")

    @model_validator(mode="after")
    def _mixture(self) -> "DataSpec":
        names = [s.name for s in self.sources]
        tok = self.tokenizer
        if not (tok == "bytes" or tok.endswith(".json") or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", tok)):
            raise ValueError(f"tokenizer {tok!r}: use bytes, a path to a tokenizer.json, or a preset name such as llama3")
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique (got {names})")
        if sum(s.weight for s in self.sources) <= 0:
            raise ValueError("mixture weights are all zero: at least one source needs a positive weight")
        for ph in self.phases:
            unknown = set(ph.weights) - set(names)
            if unknown:
                raise ValueError(f"phase {ph.name!r} weights name unknown sources {sorted(unknown)}")
            if any((not math.isfinite(w)) or w < 0 for w in ph.weights.values()) or sum(ph.weights.values()) <= 0:
                raise ValueError(f"phase {ph.name!r} weights must be >= 0 with a positive sum")
        if self.total_tokens < self.tokens_per_step:
            raise ValueError(
                f"total_tokens ({self.total_tokens}) is less than one step ({self.batch_size} x {self.seq_len})"
            )
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def total_steps(self) -> int:
        return self.total_tokens // self.tokens_per_step


class OptimSpec(_Frozen):
    peak_lr: float = Field(gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    z_loss: float = Field(default=1e-4, ge=0, description="logit z-loss coefficient on the output")
    aux_loss: float = Field(default=1e-2, ge=0, description="router load-balancing loss coefficient")
    router_z_loss: float = Field(default=1e-3, ge=0)
    moments: Literal["fp32", "bf16"] = Field(
        default="fp32", description="dtype Adam's two moments are stored in (the update's arithmetic "
        "is fp32 either way); bf16 as DeepSeek-V3 trained: 20 bytes a parameter instead of 28")

    @model_validator(mode="after")
    def _bf16_moments(self) -> "OptimSpec":
        if self.moments == "bf16" and self.beta2 > BF16_MOMENTS_MAX_BETA2:
            raise ValueError(f"optim.moments bf16 needs beta2 <= {BF16_MOMENTS_MAX_BETA2} (got {self.beta2}): "
                             "above it a step's change to the second moment is lost in bf16's rounding")
        return self


class Rejoin(_Frozen):
    """A replan point: up to `step` the schedule ran with `prev_total_steps`; from there the decay
    is re-timed to reach min_lr_ratio x peak at the new end."""

    step: int = Field(ge=0)
    prev_total_steps: int = Field(gt=0)


class CooldownBranch(_Frozen):
    name: str
    start_frac: float = Field(gt=0, lt=1)
    length_frac: float = Field(gt=0, le=1)


class ScheduleSpec(_Frozen):
    warmup_frac: float = Field(default=0.01, ge=0, lt=1)
    warmup_steps: int | None = Field(default=None, ge=0, description="overrides warmup_frac when set")
    decay: Literal["linear", "cosine", "wsd", "constant"] = "linear"
    min_lr_ratio: float = Field(default=0.05, ge=0, le=1)
    decay_start_frac: float | None = Field(
        default=None, ge=0, lt=1, description="wsd: where the decay begins (default 0.8); others: end of warmup"
    )
    decay_end_frac: float = Field(default=1.0, gt=0, le=1)
    rejoins: tuple[Rejoin, ...] = ()
    cooldown_branches: tuple[CooldownBranch, ...] = ()


class HardwareSpec(_Frozen):
    system: str = "cpu"
    n_gpus: int = Field(default=0, ge=0)
    ep_domain: int = Field(default=1, gt=0, description="GPUs in one expert-parallel domain")
    peak_flops: float = Field(default=1e12, gt=0, description="dense bf16 FLOP/s of one device")
    hbm_gb: float = Field(default=24.0, gt=0, description="memory of one device")
    expected_mfu: float = Field(default=0.4, gt=0, le=1)
    task_cpus: float = Field(default=1, ge=0, description="Ray resources of one run")
    task_gpus: float = Field(default=0, ge=0)
    # several processes for one run (a data x expert mesh: workers = dp * model.ep_size), started
    # by Ray Train; task_cpus / task_gpus are then each worker's. Not part of the spec id.
    workers: int = Field(default=1, gt=0, description="processes of one run (Ray Train workers)")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="how the workers are placed over the nodes (a Ray placement strategy)")


class RunSettings(_Frozen):
    checkpoint_every: int = Field(default=50, gt=0)
    eval_every: int = Field(default=50, gt=0)
    eval_batches: int = Field(default=2, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)


class Lineage(_Frozen):
    parent_id: str | None = None
    reason: str | None = None
    resume_step: int | None = Field(default=None, ge=0, description="continue the parent's run from this step")


class Spec(_Frozen):
    name: str = Field(min_length=1, description="rung name, e.g. d768 (letters, digits, . _ + -)")
    role: Literal["rung", "hero", "branch"] = "rung"
    engine: str = "torch"
    seed: int = Field(default=0, ge=0)
    model: ModelSpec
    data: DataSpec
    optim: OptimSpec
    schedule: ScheduleSpec = ScheduleSpec()
    hardware: HardwareSpec = HardwareSpec()
    run: RunSettings = RunSettings()
    lineage: Lineage = Lineage()
    options: Options = Options()  # how an engine computes it (core/options.py); not in the id

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name(v, "spec name")

    @model_validator(mode="after")
    def _cross(self) -> "Spec":
        if self.data.tokenizer == "bytes" and self.model.vocab_size < 256:
            raise ValueError(f"byte-level tokens need vocab_size >= 256 (got {self.model.vocab_size})")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Only the options a spec sets, and no `options` key where it sets none (a spec file
        without options reads as it did before the section was there)."""
        out = handler(self)
        if isinstance(out, dict) and "options" in out:
            given = self.options.set_fields()
            if given:
                out["options"] = given
            else:
                del out["options"]
        return out

    # ---- identity -------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        out = self.model_dump(mode="json", include=set(IDENTITY_FIELDS))
        for (section, key), default in LATE_FIELDS.items():
            if out[section].get(key) == default:
                del out[section][key]
        return out

    @property
    def id(self) -> str:
        canon = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @property
    def total_steps(self) -> int:
        return self.data.total_steps

    # ---- io -------------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    def replace(self, **changes: Any) -> "Spec":
        """A validated copy with nested changes given as {"optim.peak_lr": 1e-3, ...}."""
        data = self.model_dump(mode="json")
        for dotted, value in changes.items():
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {}) if p == "options" else node[p]
            node[leaf] = value
        return Spec.model_validate(data)


class SpecError(InputError):
    """A spec file that cannot be read; the message names the file and the problem."""


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}")
    return "; ".join(lines)


def spec_from_dict(data: Any, origin: str = "<dict>") -> Spec:
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: a spec must be a mapping, got {type(data).__name__}")
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(f"{origin}: invalid spec: {format_validation_error(err)}") from err


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    if not path.exists():
        raise SpecError(f"{path}: no such spec file")
    if path.is_dir():
        raise SpecError(f"{path}: is a directory, not a spec file")
    try:
        text = read_text(path)
    except InputLimitError as err:
        raise SpecError(str(err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read the spec file ({type(err).__name__}: {err})") from err
    try:
        data = parse_json(text, str(path)) if path.suffix == ".json" else parse_yaml(text, str(path))
    except InputLimitError as err:
        raise SpecError(str(err)) from None
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise SpecError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from err
    return spec_from_dict(data, str(path))


def save_spec(spec: Spec, path: str | Path) -> Path:
    path = Path(path)
    return atomic_write_text(path, spec.to_json() if path.suffix == ".json" else spec.to_yaml())
