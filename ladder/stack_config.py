"""A spec for a run another stack trains, from that stack's own config file.

    spec = spec_from_olmo_core(json.load(open("config.json")), name="olmoe-1b7b", overrides={...})
    spec = spec_from_stack(detect_stack(cfg), cfg, name, overrides, origin, notes)

OLMo-core writes its experiment config as JSON (`ConfigSaverCallback`, `config.json` in every
checkpoint directory, and the same dict as the W&B / Comet run config): `Config.as_config_dict()`
of an `ExperimentConfig` (src/olmo_core/internal/experiment.py: model, dataset, data_loader,
train_module, trainer, init_seed), each nested config with its class under `_CLASS_`. Read from it:

| spec | OLMo-core |
|---|---|
| model.d_model, n_layers, vocab_size, init_std | model.d_model, n_layers, vocab_size, init_std |
| model.n_heads, n_kv_heads, head_dim, rope_theta | model.block.attention.n_heads, n_kv_heads, head_dim, rope.theta |
| model.n_routed_experts, top_k, expert_hidden | model.block.feed_forward_moe.num_experts, router.top_k, hidden_size |
| model.n_shared_experts, shared_hidden | feed_forward_moe.shared_mlp (one, its hidden_size) |
| model.latent_dim | feed_forward_moe.latent_moe.latent_dim |
| model.router_kind | feed_forward_moe.router.gating_function (softmax, sigmoid) |
| model.dispatch, capacity factors | feed_forward_moe.capacity_factor (none: dropless) |
| data.seq_len | dataset.sequence_length (else train_module.max_sequence_length) |
| data.batch_size | data_loader.global_batch_size (tokens) / seq_len |
| data.total_tokens | trainer.max_duration (tokens, or steps x batch tokens) |
| optim.peak_lr, beta1, beta2, eps, weight_decay | train_module.optim.lr, betas, eps, weight_decay |
| optim.grad_clip, z_loss | train_module.max_grad_norm, z_loss_multiplier |
| optim.aux_loss, router_z_loss | feed_forward_moe.lb_loss_weight, z_loss_weight |
| schedule | train_module.scheduler: CosWithWarmup -> cosine, LinearWithWarmup -> linear, WSD -> wsd, ConstantWithWarmup -> constant; warmup (steps) or warmup_fraction; alpha_f (or WSD's decay_min_lr / lr) -> min_lr_ratio; WSD decay_fraction -> decay_start_frac |
| seed | init_seed |

Levanter/Marin YAMLs are read by ladder/stack_levanter.py and torchtitan TOMLs by
ladder/stack_torchtitan.py, each with its stack's own defaults; `detect_stack` tells the three apart.
Every reader takes a `notes` list and names in it each field that has no place in a spec (QK-norm,
reordered norms, tied embeddings, ...), so nothing is dropped silently.

A dense model (feed_forward, no feed_forward_moe) becomes one routed expert, top-1. The data
source is named after the dataset's mix (or `data`) with the dataset's paths as given: the spec
describes the run; it is not a recipe to train it here. Anything missing, or to be changed, comes
from `overrides` ({"data.total_tokens": ..., "hardware.n_gpus": ...}). Every problem is a
StackConfigError naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from analysis.runs.wandb_runs import WandbDirSource, open_wandb
from core.safeload import InputLimitError, load_file
from core.spec import Spec
from ladder.stack_common import StackConfigError, get as _get, get_int as _int, get_pair as _pair, validated as _validated
from ladder.stack_levanter import spec_from_levanter
from ladder.stack_torchtitan import spec_from_torchtitan

__all__ = ["STACKS", "StackConfigError", "detect_stack", "load_stack_config", "spec_from_levanter", "spec_from_olmo_core",
           "spec_from_stack", "spec_from_torchtitan"]

STACKS = ("olmo-core", "levanter", "marin", "torchtitan")


def _class(d: Any) -> str:
    return str((d or {}).get("_CLASS_", "")).rsplit(".", 1)[-1] if isinstance(d, dict) else ""


def _block(model: dict, origin: str) -> dict:
    block = model.get("block")
    if not isinstance(block, dict):
        raise StackConfigError(f"{origin}: no model.block in the config")
    if "attention" in block or "sequence_mixer" in block or "feed_forward_moe" in block or "feed_forward" in block:
        return block
    # a named set of blocks (block_pattern): the first MoE block, else the first block
    named = [b for b in block.values() if isinstance(b, dict)]
    if not named:
        raise StackConfigError(f"{origin}: model.block holds no block config")
    return next((b for b in named if b.get("feed_forward_moe")), named[0])


def _model(cfg: dict, origin: str) -> dict:
    model = cfg.get("model")
    if not isinstance(model, dict):
        raise StackConfigError(f"{origin}: no model section (is this an OLMo-core experiment config.json?)")
    d_model = _int(model, "d_model", origin, minimum=1)
    block = _block(model, origin)
    attn = block.get("attention") or block.get("sequence_mixer") or {}
    n_heads = _int(attn, "n_heads", origin + " model.block.attention", 16, minimum=1)
    n_kv = _get(attn, "n_kv_heads", origin + " model.block.attention", n_heads)
    out: dict[str, Any] = {
        "n_layers": _get(model, "n_layers", origin),
        "d_model": d_model,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": _get(attn, "head_dim", origin, d_model // n_heads),
        "vocab_size": _get(model, "vocab_size", origin),
        "init_std": _get(model, "init_std", origin, 0.02),
        "rope_theta": _get(attn, "rope.theta", origin, 10000.0),
        "norm_eps": _get(block, "layer_norm.eps", origin, 1e-5),
    }
    moe = block.get("feed_forward_moe")
    if isinstance(moe, dict):
        gating = str(_get(moe, "router.gating_function", origin, "softmax", types=(str,))).lower()
        shared = moe.get("shared_mlp")
        cf = _get(moe, "capacity_factor", origin, None)
        out.update({
            "n_routed_experts": _get(moe, "num_experts", origin + " model.block.feed_forward_moe", 1),
            "top_k": _get(moe, "router.top_k", origin + " model.block.feed_forward_moe", 1),
            "expert_hidden": _get(moe, "hidden_size", origin + " model.block.feed_forward_moe", 256),
            "router_kind": "sigmoid" if "sigmoid" in gating else "softmax",
            "n_shared_experts": 1 if isinstance(shared, dict) else 0,
            "shared_hidden": _get(shared, "hidden_size", origin, 0) if isinstance(shared, dict) else 0,
            "router_bias_balancing": _get(moe, "router.bias_gamma", origin, None) is not None,
        })
        latent = _get(moe, "latent_moe.latent_dim", origin, None)
        if latent is not None:
            out["latent_dim"] = latent
        if cf is not None:
            out.update({"dispatch": "capacity", "capacity_factor_send": max(float(cf), 1.0),
                        "capacity_factor_recv": max(float(cf), 1.0)})
    else:
        ff = block.get("feed_forward")
        if not isinstance(ff, dict):
            raise StackConfigError(f"{origin}: model.block has neither feed_forward_moe nor feed_forward")
        out.update({"n_routed_experts": 1, "top_k": 1, "expert_hidden": _get(ff, "hidden_size", origin)})
    return out


def _schedule(tm: dict, peak_lr: float, origin: str) -> dict:
    sch = tm.get("scheduler")
    if not isinstance(sch, dict):
        return {"decay": "constant", "warmup_steps": 0, "min_lr_ratio": 1.0}
    kind = _class(sch)
    cfg = {"train_module": tm}  # fields are named from the config's top

    def num(key: str, default: float) -> float:
        return float(_get(cfg, f"train_module.scheduler.{key}", origin, default))

    out: dict[str, Any] = {}
    key = "warmup" if sch.get("warmup") is not None else "warmup_steps"
    if sch.get(key) is not None:
        out["warmup_steps"] = _int(cfg, f"train_module.scheduler.{key}", origin, minimum=0)
    elif sch.get("warmup_fraction") is not None:
        out["warmup_frac"] = num("warmup_fraction", 0.0)
    else:
        out["warmup_steps"] = 0
    if kind in ("CosWithWarmup", "LinearWithWarmup"):
        out.update({"decay": "cosine" if kind == "CosWithWarmup" else "linear", "min_lr_ratio": num("alpha_f", 0.1)})
    elif kind == "WSD":
        out.update({"decay": "wsd", "min_lr_ratio": num("decay_min_lr", 0.0) / peak_lr,
                    "decay_start_frac": 1.0 - (num("decay_fraction", 0.1) or 0.1)})
    elif kind in ("ConstantWithWarmup", "ConstantScheduler"):
        out.update({"decay": "constant", "min_lr_ratio": 1.0})
    else:
        raise StackConfigError(f"{origin}: train_module.scheduler {kind or '(no _CLASS_)'} is not one this project "
                               "models (CosWithWarmup, LinearWithWarmup, WSD, ConstantWithWarmup); give --set schedule.*")
    return out


def _olmo_core_notes(cfg: dict, origin: str) -> list[str]:
    """Fields of an OLMo-core config that change the trained model but have no place in a spec."""
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    try:
        block = _block(model, origin)
    except StackConfigError:
        return []
    attn = block.get("attention") or block.get("sequence_mixer") or {}
    out = []
    # src/olmo_core/nn/attention/__init__.py AttentionConfig: qk_norm (a LayerNormConfig), clip_qkv,
    # bias, sliding_window; src/olmo_core/nn/transformer/config.py TransformerBlockConfig.name
    if isinstance(attn.get("qk_norm"), dict):
        out.append(f"model.block.attention.qk_norm ({attn['qk_norm'].get('name', 'rms')} norm on queries and keys)")
    for key in ("clip_qkv", "sliding_window"):
        if attn.get(key) not in (None, False):
            out.append(f"model.block.attention.{key} ({attn[key]})")
    if attn.get("bias"):
        out.append("model.block.attention.bias (true)")
    kind = str(block.get("name", "default"))
    if kind not in ("default", "moe", "reordered_norm", "moe_reordered_norm"):
        out.append(f"model.block.name ({kind})")
    elif "reordered_norm" in kind:
        out.append(f"model.block.name ({kind}: norms after attention and feed-forward)")
    return out


def spec_from_olmo_core(cfg: dict, name: str, overrides: dict[str, Any] | None = None, origin: str = "config",
                        notes: list[str] | None = None) -> Spec:
    if notes is not None and isinstance(cfg, dict):
        notes.extend(_olmo_core_notes(cfg, origin))
    if not isinstance(cfg, dict):
        raise StackConfigError(f"{origin}: an OLMo-core config is a JSON object")
    tm = cfg.get("train_module")
    if not isinstance(tm, dict):
        raise StackConfigError(f"{origin}: no train_module section (is this an OLMo-core experiment config.json?)")
    seq = _int(cfg, "dataset.sequence_length", origin, None, minimum=1)
    if seq is None:
        seq = _int(cfg, "train_module.max_sequence_length", origin, None, minimum=1)
    if seq is None:
        raise StackConfigError(f"{origin}: no dataset.sequence_length nor train_module.max_sequence_length")
    batch_tokens = _int(cfg, "data_loader.global_batch_size", origin, minimum=1)
    if batch_tokens % seq:
        raise StackConfigError(f"{origin}: data_loader.global_batch_size {batch_tokens} is not a multiple of the "
                               f"sequence length {seq}")
    total = None
    dur = (cfg.get("trainer") or {}).get("max_duration")
    if isinstance(dur, dict) and dur.get("value") is not None:
        unit = str(dur.get("unit", "steps"))
        if unit == "tokens":
            total = _int(cfg, "trainer.max_duration.value", origin, minimum=1)
        elif unit == "steps":
            total = _int(cfg, "trainer.max_duration.value", origin, minimum=1) * batch_tokens
    overrides = dict(overrides or {})
    if total is None and "data.total_tokens" not in overrides:
        raise StackConfigError(f"{origin}: trainer.max_duration is not in tokens or steps; give --set data.total_tokens=N")
    if tm.get("optim") is not None and not isinstance(tm["optim"], dict):
        raise StackConfigError(f"{origin}: train_module.optim is {tm['optim']!r}, expected a section")
    peak = float(_get(cfg, "train_module.optim.lr", origin))
    if peak <= 0:
        raise StackConfigError(f"{origin}: train_module.optim.lr is {peak:g}, expected a positive number")
    beta1, beta2 = _pair(cfg, "train_module.optim.betas", origin, (0.9, 0.999))
    moe = (_block(cfg["model"], origin) if isinstance(cfg.get("model"), dict) else {}).get("feed_forward_moe") or {}
    data_cfg = cfg.get("dataset") or {}
    paths = tuple(str(p) for p in (data_cfg.get("paths") or ()) if isinstance(p, str))
    mix = data_cfg.get("mix")
    tok = str(_get(data_cfg, "tokenizer.identifier", origin, "bytes", types=(str,))).rsplit("/", 1)[-1]

    def num(path: str, default: float) -> float:
        return float(_get(cfg, path, origin, default))

    ffm = "model.block.feed_forward_moe"  # (the MoE block _block picked, named at OLMo-core's usual place)
    moe_cfg = {"model": {"block": {"feed_forward_moe": moe}}}
    spec_dict: dict[str, Any] = {
        "name": name,
        "seed": _int(cfg, "init_seed", origin, 0),
        "model": _model(cfg, origin),
        "data": {
            "sources": [{"name": str(mix or "data"), "weight": 1.0, "paths": list(paths or (str(mix or origin),))}],
            "tokenizer": tok,
            "seq_len": seq,
            "batch_size": batch_tokens // seq,
            "total_tokens": int(total or batch_tokens),
        },
        "optim": {
            "peak_lr": peak, "beta1": beta1, "beta2": beta2,
            "eps": num("train_module.optim.eps", 1e-8), "weight_decay": num("train_module.optim.weight_decay", 0.01),
            "grad_clip": num("train_module.max_grad_norm", 0.0) or 1e9,
            "z_loss": num("train_module.z_loss_multiplier", 0.0),
            "aux_loss": float(_get(moe_cfg, f"{ffm}.lb_loss_weight", origin, 0.0) or 0.0),
            "router_z_loss": float(_get(moe_cfg, f"{ffm}.z_loss_weight", origin, 0.0) or 0.0),
        },
        "schedule": _schedule(tm, peak, origin),
    }
    return _validated(spec_dict, overrides, origin)


def spec_from_stack(stack: str, cfg: Any, name: str, overrides: dict[str, Any] | None = None, origin: str = "config",
                    notes: list[str] | None = None) -> Spec:
    """The spec of a run `stack` trains from `cfg`; `notes` collects the fields it could not carry."""
    if stack == "olmo-core":
        return spec_from_olmo_core(cfg, name, overrides, origin, notes)
    if stack in ("levanter", "marin"):
        return spec_from_levanter(cfg, name, overrides, origin, notes)
    if stack == "torchtitan":
        return spec_from_torchtitan(cfg, name, overrides, origin, notes)
    raise StackConfigError(f"--stack {stack!r}: known stacks are {', '.join(STACKS)}")


def detect_stack(cfg: Any, origin: str = "config") -> str:
    """Which stack wrote a config, from its shape: OLMo-core's JSON has `_CLASS_` entries and a
    train_module; a torchtitan TOML has [model] name/flavor and [training]; a Levanter YAML has
    model/trainer/optimizer sections."""
    if isinstance(cfg, dict):
        if isinstance(cfg.get("train_module"), dict) or "_CLASS_" in str(cfg.get("model", ""))[:2000]:
            return "olmo-core"
        model = cfg.get("model")
        if isinstance(model, dict) and "flavor" in model and isinstance(cfg.get("training"), dict):
            return "torchtitan"
        if isinstance(model, dict) and ("trainer" in cfg or "optimizer" in cfg):
            return "levanter"
    raise StackConfigError(f"{origin}: cannot tell which stack wrote this config (not OLMo-core's config.json, "
                           "a Levanter/Marin train_lm YAML nor a torchtitan TOML); give --stack")


def _wandb_config(ref: str) -> dict:
    """The config a W&B run was started with (OLMo-core's W&B callback gives it the experiment config,
    Levanter's tracker its TrainLmConfig): wandb:DIR or wandb:ENTITY/PROJECT/RUN_ID."""
    try:
        src = open_wandb(ref)
        if isinstance(src, WandbDirSource):
            src.read_config()
    except ValueError as e:
        raise StackConfigError(str(e)) from None
    cfg = {k: v for k, v in src.config.items() if not k.startswith("_")}
    if not cfg:
        raise StackConfigError(f"{ref}: the W&B run was started without a config")
    return cfg


def load_stack_config(path: str | Path) -> dict:
    """A stack's config from its file (JSON, YAML, TOML) or from a W&B run's config (wandb:...)."""
    if str(path).startswith("wandb:"):
        return _wandb_config(str(path))
    p = Path(path)
    if not p.is_file():
        raise StackConfigError(f"{p}: no such config file")
    try:
        return load_file(p)
    except InputLimitError as e:
        raise StackConfigError(str(e)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StackConfigError(f"{p}: not valid JSON ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise StackConfigError(f"{p}: not valid TOML ({e})") from None
    except (yaml.YAMLError, OSError) as e:
        raise StackConfigError(f"{p}: not readable ({str(e).splitlines()[0]})") from None
