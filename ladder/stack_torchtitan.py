"""A spec from a torchtitan job TOML (`--job.config_file`), with torchtitan's own defaults and model flavors.

    spec = spec_from_torchtitan(tomllib.load(open("qwen3_30b.toml", "rb")), "qwen3-30b", notes=notes)

A torchtitan TOML names a model by `[model] name` and `flavor`; the shape is the flavor's entry in the
model's args registry, the rest comes from `[optimizer]`, `[lr_scheduler]` and `[training]`, each
field the TOML leaves out at its `JobConfig` default (torchtitan/config/job_config.py). Paths and
lines are pytorch/torchtitan v0.2.2, the last release that reads TOML job files. `notes` collects
the fields the spec cannot carry (QK-norm, tied embeddings, top-k weight renormalisation, ...).
"""

from __future__ import annotations

from typing import Any

from core.spec import Spec
from ladder.stack_common import StackConfigError, get, get_int, validated

__all__ = ["FLAVORS", "spec_from_torchtitan"]


def _llama3_hidden(dim: int, multiple_of: int = 256, mult: float | None = None) -> int:
    """torchtitan/models/llama3/model/model.py FeedForward: int(2 * 4 * dim / 3), times
    ffn_dim_multiplier, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if mult is not None:
        hidden = int(mult * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _llama3(dim: int, n_layers: int, n_heads: int, n_kv: int | None = None, vocab: int = 128256,
            mult: float | None = None, multiple_of: int = 256, theta: float = 500000) -> dict[str, Any]:
    # torchtitan/models/llama3/model/args.py:29-47 (TransformerModelArgs defaults: vocab 128256,
    # multiple_of 256, norm_eps 1e-5, rope_theta 10000, untied output)
    return {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv or n_heads,
            "head_dim": dim // n_heads, "vocab_size": vocab, "hidden_dim": _llama3_hidden(dim, multiple_of, mult),
            "norm_eps": 1e-5, "rope_theta": theta, "qk_norm": False, "tied": False, "moe": None}


def _qwen3(dim: int, n_layers: int, n_heads: int, n_kv: int, hidden: int, vocab: int = 151936, theta: float = 1e6,
           tied: bool = False, moe: tuple[int, int, int] | None = None) -> dict[str, Any]:
    # torchtitan/models/qwen3/model/args.py:23-48 (Qwen3ModelArgs: head_dim 128, norm_eps 1e-6,
    # qk_norm True); moe = (num_experts, top_k, moe_inter_dim) with MoEArgs as each flavor sets it
    # (num_shared_experts 0, score_func softmax, route_norm True)
    return {"dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": 128,
            "vocab_size": vocab, "hidden_dim": hidden, "norm_eps": 1e-6, "rope_theta": theta, "qk_norm": True,
            "tied": tied, "moe": moe, "route_norm": True, "score_func": "softmax"}


FLAVORS: dict[str, dict[str, dict[str, Any]]] = {
    # torchtitan/models/llama3/__init__.py:29-100 (llama3_args)
    "llama3": {
        "debugmodel": _llama3(256, 6, 16, vocab=2048),
        "8B": _llama3(4096, 32, 32, 8, mult=1.3, multiple_of=1024),
        "70B": _llama3(8192, 80, 64, 8, mult=1.3, multiple_of=4096),
        "405B": _llama3(16384, 126, 128, 8, mult=1.2, multiple_of=4096),
    },
    # torchtitan/models/qwen3/__init__.py:32-190 (qwen3_args)
    "qwen3": {
        "debugmodel": _qwen3(256, 8, 16, 8, 3072, vocab=2048, tied=True),
        "0.6B": _qwen3(1024, 28, 16, 8, 3072, tied=True),
        "1.7B": _qwen3(2048, 28, 16, 8, 6144, tied=True),
        "4B": _qwen3(2560, 36, 32, 8, 9728, tied=True),
        "8B": _qwen3(4096, 36, 32, 8, 12288),
        "14B": _qwen3(5120, 40, 40, 8, 17408),
        "32B": _qwen3(5120, 64, 64, 8, 25600),
        "debugmodel_moe": _qwen3(256, 8, 16, 8, 3072, vocab=2048, moe=(64, 8, 768)),
        "30B-A3B": _qwen3(2048, 48, 32, 4, 6144, moe=(128, 8, 768)),
        "235B-A22B": _qwen3(4096, 94, 64, 4, 12288, theta=5e6, moe=(128, 8, 1536)),
    },
}
# torchtitan/config/job_config.py:134-148 (Optimizer), :169-200 (LRScheduler), :243-267 (Training),
# :985-986 (Debug.seed: None, a random seed)
OPTIMIZER = {"name": "AdamW", "lr": 8e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
LR_SCHEDULER = {"warmup_steps": 200, "decay_ratio": None, "decay_type": "linear", "min_lr_factor": 0.0}
TRAINING = {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "max_norm": 1.0, "steps": 10000}
# torchtitan/models/moe/moe.py:38 MoEArgs.load_balance_coeff = 1e-3: the auxiliary-loss-free expert
# bias update (DeepSeek-V3), not a loss term
LOAD_BALANCE_COEFF = 1e-3


def spec_from_torchtitan(cfg: dict, name: str, overrides: dict[str, Any] | None = None, origin: str = "config",
                         notes: list[str] | None = None) -> Spec:
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise StackConfigError(f"{origin}: no [model] table (is this a torchtitan job TOML?)")
    notes = notes if notes is not None else []
    overrides = dict(overrides or {})
    model, opt = cfg["model"], cfg.get("optimizer") or {}
    sch, tr = cfg.get("lr_scheduler") or {}, cfg.get("training") or {}
    arch, flavor = str(model.get("name", "llama3")), str(model.get("flavor", "debugmodel"))
    if arch not in FLAVORS:
        raise StackConfigError(f"{origin}: model.name {arch!r} is not one this reader knows ({', '.join(FLAVORS)}; "
                               "DeepSeek-V3's latent attention and Llama 4's interleaved layers have no spec form)")
    if flavor not in FLAVORS[arch]:
        raise StackConfigError(f"{origin}: model.flavor {flavor!r} is not one of torchtitan's {arch} flavors "
                               f"({', '.join(FLAVORS[arch])})")
    f = FLAVORS[arch][flavor]
    seq = int(get(tr, "seq_len", origin + " training", TRAINING["seq_len"]))
    steps = int(get(tr, "steps", origin + " training", TRAINING["steps"]))
    gbs = int(get(tr, "global_batch_size", origin + " training", TRAINING["global_batch_size"]))
    if gbs < 0:
        # torchtitan/train.py:196-200: local_batch_size x the data-parallel degree
        par = cfg.get("parallelism") or {}
        rep = get_int(par, "data_parallel_replicate_degree", origin + " parallelism", 1)
        shard = get_int(par, "data_parallel_shard_degree", origin + " parallelism", -1)
        local = int(get(tr, "local_batch_size", origin + " training", TRAINING["local_batch_size"]))
        if shard > 0 and rep > 0:
            gbs = local * rep * shard
        elif "data.batch_size" not in overrides:
            raise StackConfigError(f"{origin}: training.global_batch_size is unset and the data-parallel degree comes "
                                   "from the GPU count at launch; give --set data.batch_size=N (sequences)")
        else:
            gbs = int(overrides["data.batch_size"])

    def o(key: str, types: tuple = (int, float)) -> Any:
        return get(opt, key, origin + " optimizer", OPTIMIZER[key], types=types)

    def s(key: str, types: tuple = (int, float)) -> Any:
        return get(sch, key, origin + " lr_scheduler", LR_SCHEDULER[key], types=types)

    if str(o("name", types=(str,))) not in ("AdamW", "Adam"):
        notes.append(f"optimizer.name ({o('name', types=(str,))}: modelled as AdamW)")
    decay_type, ratio = str(s("decay_type", types=(str,))), s("decay_ratio")
    schedule: dict[str, Any] = {"warmup_steps": int(s("warmup_steps")), "min_lr_ratio": float(s("min_lr_factor"))}
    if ratio is None:
        if decay_type not in ("linear", "cosine"):
            raise StackConfigError(f"{origin}: lr_scheduler.decay_type {decay_type!r} is not one this project models "
                                   "(linear, cosine); give --set schedule.*")
        schedule["decay"] = decay_type
    else:
        if decay_type != "linear":
            notes.append(f"lr_scheduler.decay_type ({decay_type}: a WSD decay here is linear)")
        schedule.update({"decay": "wsd", "decay_start_frac": 1.0 - float(ratio)})
    if sch.get("total_steps") not in (None, steps):
        notes.append(f"lr_scheduler.total_steps ({sch['total_steps']}: the spec's schedule spans training.steps)")
    if f["qk_norm"]:
        notes.append(f"model.qk_norm (torchtitan's {arch} normalises queries and keys)")
    if f["tied"]:
        notes.append(f"model.enable_weight_tying ({flavor}: counted here as an untied output layer)")
    if model.get("converters"):
        notes.append(f"model.converters ({', '.join(map(str, model['converters']))})")
    moe = f["moe"]
    m: dict[str, Any] = {
        "n_layers": f["n_layers"], "d_model": f["dim"], "n_heads": f["n_heads"], "n_kv_heads": f["n_kv_heads"],
        "head_dim": f["head_dim"], "vocab_size": f["vocab_size"], "norm_eps": f["norm_eps"],
        "rope_theta": float(f["rope_theta"]),
    }
    if moe is None:
        m.update({"n_routed_experts": 1, "top_k": 1, "expert_hidden": f["hidden_dim"]})
    else:
        n_exp, top_k, inter = moe
        m.update({"n_routed_experts": n_exp, "top_k": top_k, "expert_hidden": inter,
                  "router_kind": f.get("score_func", "softmax"), "router_bias_balancing": True,
                  "router_bias_rate": LOAD_BALANCE_COEFF})
        if f.get("route_norm"):
            notes.append("moe_args.route_norm (top-k weights renormalised to sum to 1)")
    spec_dict: dict[str, Any] = {
        "name": name,
        "seed": int((cfg.get("debug") or {}).get("seed") or 0),
        "model": m,
        "data": {
            "sources": [{"name": str(tr.get("dataset", "c4_test")), "weight": 1.0,
                         "paths": [str(tr.get("dataset_path") or tr.get("dataset") or "c4_test")]}],
            "seq_len": seq, "batch_size": gbs, "total_tokens": steps * gbs * seq,
        },
        "optim": {
            "peak_lr": float(o("lr")), "beta1": float(o("beta1")), "beta2": float(o("beta2")), "eps": float(o("eps")),
            "weight_decay": float(o("weight_decay")),
            "grad_clip": float(get(tr, "max_norm", origin, TRAINING["max_norm"]) or 1e9),
        },
        "schedule": schedule,
    }
    if not (cfg.get("debug") or {}).get("seed"):
        notes.append("debug.seed (unset: torchtitan draws a random seed; the spec says 0)")
    return validated(spec_dict, overrides, origin)
