"""A spec for a run another stack trains, from that stack's own config file.

    spec = spec_from_olmo_core(json.load(open("config.json")), name="olmoe-1b7b", overrides={...})

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

Levanter (and Marin, which trains with it) reads a draccus YAML (`levanter.main.train_lm`'s
TrainLmConfig): model (`type: mixtral` or a dense type: hidden_dim, intermediate_dim, num_layers,
num_heads, num_kv_heads, seq_len, n_routed_experts, num_experts_per_tok, n_shared_experts, lbl_coef,
rzl_coef, initializer_range, layer_norm_epsilon, rope.theta), trainer (train_batch_size in sequences,
num_train_steps, seed), optimizer (learning_rate, weight_decay, beta1, beta2, epsilon,
max_grad_norm, warmup as steps or a fraction, min_lr_ratio, lr_schedule cosine | linear | constant,
`decay` as steps or a fraction: a linear decay over it is WSD here), z_loss_weight. Levanter takes
the vocabulary from its tokenizer, so `model.vocab_size` comes from `--set`.

A dense model (feed_forward, no feed_forward_moe) becomes one routed expert, top-1. The data
source is named after the dataset's mix (or `data`) with the dataset's paths as given: the spec
describes the run; it is not a recipe to train it here. Anything missing, or to be changed, comes
from `overrides` ({"data.total_tokens": ..., "hardware.n_gpus": ...}). Every problem is a
StackConfigError naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.spec import Spec, SpecError, spec_from_dict

__all__ = ["STACKS", "StackConfigError", "load_stack_config", "spec_from_levanter", "spec_from_olmo_core", "spec_from_stack"]

STACKS = ("olmo-core", "levanter", "marin")


class StackConfigError(ValueError):
    """A stack config that cannot become a spec; the message names the file and field."""


def _get(d: Any, path: str, origin: str, default: Any = ..., types: tuple = (int, float)) -> Any:
    node = d
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            if default is ...:
                raise StackConfigError(f"{origin}: no {path} in the config")
            return default
        node = node[part]
    if types == (int, float) and isinstance(node, str):
        try:  # YAML 1.1 reads 6e-4 (no dot) as a string
            node = float(node) if any(ch in node for ch in ".eE") else int(node)
        except ValueError:
            pass
    if types and not (isinstance(node, types) and not isinstance(node, bool)):
        raise StackConfigError(f"{origin}: {path} is {node!r}, expected a number")
    return node


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
    d_model = _get(model, "d_model", origin)
    block = _block(model, origin)
    attn = block.get("attention") or block.get("sequence_mixer") or {}
    n_heads = _get(attn, "n_heads", origin + " model.block.attention", 16)
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
    out: dict[str, Any] = {}
    warm = sch.get("warmup", sch.get("warmup_steps"))
    if warm is not None:
        out["warmup_steps"] = int(warm)
    elif sch.get("warmup_fraction") is not None:
        out["warmup_frac"] = float(sch["warmup_fraction"])
    else:
        out["warmup_steps"] = 0
    if kind == "CosWithWarmup":
        out.update({"decay": "cosine", "min_lr_ratio": float(sch.get("alpha_f", 0.1))})
    elif kind == "LinearWithWarmup":
        out.update({"decay": "linear", "min_lr_ratio": float(sch.get("alpha_f", 0.1))})
    elif kind == "WSD":
        out.update({"decay": "wsd", "min_lr_ratio": float(sch.get("decay_min_lr", 0.0)) / peak_lr,
                    "decay_start_frac": 1.0 - float(sch.get("decay_fraction") or 0.1)})
    elif kind in ("ConstantWithWarmup", "ConstantScheduler"):
        out.update({"decay": "constant", "min_lr_ratio": 1.0})
    else:
        raise StackConfigError(f"{origin}: train_module.scheduler {kind or '(no _CLASS_)'} is not one this project "
                               "models (CosWithWarmup, LinearWithWarmup, WSD, ConstantWithWarmup); give --set schedule.*")
    return out


def spec_from_olmo_core(cfg: dict, name: str, overrides: dict[str, Any] | None = None, origin: str = "config") -> Spec:
    if not isinstance(cfg, dict):
        raise StackConfigError(f"{origin}: an OLMo-core config is a JSON object")
    tm = cfg.get("train_module")
    if not isinstance(tm, dict):
        raise StackConfigError(f"{origin}: no train_module section (is this an OLMo-core experiment config.json?)")
    seq = _get(cfg, "dataset.sequence_length", origin, None) or _get(tm, "max_sequence_length", origin, None)
    if seq is None:
        raise StackConfigError(f"{origin}: no dataset.sequence_length nor train_module.max_sequence_length")
    batch_tokens = _get(cfg, "data_loader.global_batch_size", origin)
    if batch_tokens % seq:
        raise StackConfigError(f"{origin}: data_loader.global_batch_size {batch_tokens} is not a multiple of the "
                               f"sequence length {seq}")
    total = None
    dur = (cfg.get("trainer") or {}).get("max_duration")
    if isinstance(dur, dict) and dur.get("value") is not None:
        unit = str(dur.get("unit", "steps"))
        if unit == "tokens":
            total = int(dur["value"])
        elif unit == "steps":
            total = int(dur["value"]) * int(batch_tokens)
    overrides = dict(overrides or {})
    if total is None and "data.total_tokens" not in overrides:
        raise StackConfigError(f"{origin}: trainer.max_duration is not in tokens or steps; give --set data.total_tokens=N")
    optim = tm.get("optim") or {}
    peak = _get(optim, "lr", origin + " train_module.optim")
    betas = optim.get("betas") or [0.9, 0.999]
    moe = (_block(cfg["model"], origin) if isinstance(cfg.get("model"), dict) else {}).get("feed_forward_moe") or {}
    data_cfg = cfg.get("dataset") or {}
    paths = tuple(str(p) for p in (data_cfg.get("paths") or ()) if isinstance(p, str))
    mix = data_cfg.get("mix")
    tok = str(_get(data_cfg, "tokenizer.identifier", origin, "bytes", types=(str,))).rsplit("/", 1)[-1]
    spec_dict: dict[str, Any] = {
        "name": name,
        "seed": int(_get(cfg, "init_seed", origin, 0)),
        "model": _model(cfg, origin),
        "data": {
            "sources": [{"name": str(mix or "data"), "weight": 1.0, "paths": list(paths or (str(mix or origin),))}],
            "tokenizer": tok,
            "seq_len": int(seq),
            "batch_size": int(batch_tokens) // int(seq),
            "total_tokens": int(total or batch_tokens),
        },
        "optim": {
            "peak_lr": float(peak), "beta1": float(betas[0]), "beta2": float(betas[1]),
            "eps": float(optim.get("eps", 1e-8)), "weight_decay": float(optim.get("weight_decay", 0.01)),
            "grad_clip": float(tm.get("max_grad_norm") or 1e9),
            "z_loss": float(tm.get("z_loss_multiplier") or 0.0),
            "aux_loss": float(moe.get("lb_loss_weight") or 0.0),
            "router_z_loss": float(moe.get("z_loss_weight") or 0.0),
        },
        "schedule": _schedule(tm, float(peak), origin),
    }
    return _validated(spec_dict, overrides, origin)


def _validated(spec_dict: dict, overrides: dict[str, Any], origin: str) -> Spec:
    """The spec from the config's fields with the overrides applied, validated once."""
    try:
        node_data = spec_dict
        for dotted, value in overrides.items():
            node = node_data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise StackConfigError(f"{origin}: --set {dotted}: {p} is not a section")
            node[leaf] = value
        return spec_from_dict(node_data, origin)
    except SpecError as e:
        raise StackConfigError(str(e)) from None


def spec_from_levanter(cfg: dict, name: str, overrides: dict[str, Any] | None = None, origin: str = "config") -> Spec:
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise StackConfigError(f"{origin}: no model section (is this a Levanter train_lm config?)")
    overrides = dict(overrides or {})
    if "model.vocab_size" not in overrides:
        raise StackConfigError(f"{origin}: Levanter takes the vocabulary from its tokenizer; give --set model.vocab_size=N")
    m, tr, opt = cfg["model"], cfg.get("trainer") or {}, cfg.get("optimizer") or {}
    d_model, n_heads = _get(m, "hidden_dim", origin, 4096), _get(m, "num_heads", origin, 32)
    moe = "n_routed_experts" in m or str(m.get("type", "")).lower() in ("mixtral", "olmoe", "qwen3_moe")
    steps = _get(tr, "num_train_steps", origin + " trainer")
    batch = _get(tr, "train_batch_size", origin + " trainer")
    seq = _get(m, "seq_len", origin, 4096)
    warm = _get(opt, "warmup", origin, 0.01)
    decay = _get(opt, "decay", origin, None)
    shape = str(opt.get("lr_schedule", "cosine")).lower()
    sched: dict[str, Any] = {"min_lr_ratio": float(_get(opt, "min_lr_ratio", origin, 0.1))}
    sched.update({"warmup_frac": float(warm)} if 0 < warm < 1 else {"warmup_steps": int(warm)})
    if shape == "constant":
        sched.update({"decay": "constant", "min_lr_ratio": 1.0})
    elif decay is None and shape in ("cosine", "linear"):
        sched["decay"] = shape
    elif decay is not None and shape == "linear":
        frac = float(decay) if decay < 1 else float(decay) / steps
        sched.update({"decay": "wsd", "decay_start_frac": 1.0 - frac})
    else:
        raise StackConfigError(f"{origin}: optimizer lr_schedule {shape!r}" + (f" with decay {decay}" if decay is not None else "")
                               + " is not one this project models; give --set schedule.*")
    spec_dict: dict[str, Any] = {
        "name": name,
        "seed": int(_get(tr, "seed", origin, 0)),
        "model": {
            "n_layers": _get(m, "num_layers", origin, 32), "d_model": d_model, "n_heads": n_heads,
            "n_kv_heads": _get(m, "num_kv_heads", origin, n_heads), "head_dim": _get(m, "head_dim", origin, d_model // n_heads),
            "vocab_size": 256, "init_std": _get(m, "initializer_range", origin, 0.02),
            "norm_eps": _get(m, "layer_norm_epsilon", origin, 1e-5), "rope_theta": _get(m, "rope.theta", origin, 10000.0),
            "n_routed_experts": _get(m, "n_routed_experts", origin, 8) if moe else 1,
            "top_k": _get(m, "num_experts_per_tok", origin, 2) if moe else 1,
            "expert_hidden": _get(m, "intermediate_dim", origin, 14336),
            "n_shared_experts": _get(m, "n_shared_experts", origin, 0) if moe else 0,
        },
        "data": {
            "sources": [{"name": "data", "weight": 1.0, "paths": [origin]}],
            "seq_len": int(seq), "batch_size": int(batch), "total_tokens": int(steps) * int(batch) * int(seq),
        },
        "optim": {
            "peak_lr": float(_get(opt, "learning_rate", origin, 6e-4)), "beta1": float(_get(opt, "beta1", origin, 0.9)),
            "beta2": float(_get(opt, "beta2", origin, 0.95)), "eps": float(_get(opt, "epsilon", origin, 1e-8)),
            "weight_decay": float(_get(opt, "weight_decay", origin, 0.1)),
            "grad_clip": float(_get(opt, "max_grad_norm", origin, None) or 1e9),
            "z_loss": float(_get(cfg, "z_loss_weight", origin, 0.0)),
            "aux_loss": float(_get(m, "lbl_coef", origin, 0.01) or 0.0) if moe else 0.0,
            "router_z_loss": float(_get(m, "rzl_coef", origin, 0.001) or 0.0) if moe else 0.0,
        },
        "schedule": sched,
    }
    if spec_dict["model"]["n_shared_experts"]:
        spec_dict["model"]["shared_hidden"] = spec_dict["model"]["expert_hidden"]
    return _validated(spec_dict, overrides, origin)


def spec_from_stack(stack: str, cfg: Any, name: str, overrides: dict[str, Any] | None = None, origin: str = "config") -> Spec:
    if stack == "olmo-core":
        return spec_from_olmo_core(cfg, name, overrides, origin)
    if stack in ("levanter", "marin"):
        return spec_from_levanter(cfg, name, overrides, origin)
    raise StackConfigError(f"--stack {stack!r}: known stacks are {', '.join(STACKS)}")


def load_stack_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise StackConfigError(f"{p}: no such config file")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(p.read_text())
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StackConfigError(f"{p}: not valid JSON ({e})") from None
    except Exception as e:  # yaml.YAMLError
        raise StackConfigError(f"{p}: not readable ({str(e).splitlines()[0]})") from None
