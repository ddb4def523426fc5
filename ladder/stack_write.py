"""A spec (a replan option) written back in the form its stack runs: the stack's own config with the
fields the spec decides replaced.

    text, notes = stack_form("olmo-core", json.load(open("config.json")), option_spec, resume_step=1200)

The source config is the one `ladder spec from-run` read; everything it holds that a spec does not
describe (paths, parallelism, callbacks, kernels) is kept as it was. What is set:

| spec | OLMo-core config.json | Levanter train_lm YAML | torchtitan job TOML |
|---|---|---|---|
| total tokens / steps | trainer.max_duration (tokens) | trainer.num_train_steps | training.steps |
| batch, sequence | data_loader.global_batch_size (tokens) | trainer.train_batch_size, model.seq_len | training.global_batch_size, seq_len |
| peak LR | train_module.optim.lr | optimizer.learning_rate | optimizer.lr |
| schedule | train_module.scheduler (CosWithWarmup, LinearWithWarmup, WSD, ConstantWithWarmup) | optimizer.lr_schedule, warmup, decay, min_lr_ratio | lr_scheduler.warmup_steps, decay_ratio, decay_type, min_lr_factor |
| mixture phases | - (named in notes) | data.train_weights as a weight schedule | - (named in notes) |
| resume step | trainer.load_path = save_folder/step{N} | - (named in notes) | checkpoint.load_step |
| seed | init_seed | trainer.seed | debug.seed |

`notes` name what the stack's form cannot say (a decay that ends before the last step, rejoins,
context stages, ...). The resume step is this project's: the continuation's first step is N, so N
steps are done, which is the step number OLMo-core and torchtitan give that checkpoint (they count
from 1).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import tomlkit
import yaml

from core.spec import Spec
from ladder.stack_common import StackConfigError

__all__ = ["STACK_SUFFIX", "stack_form"]

STACK_SUFFIX = {"olmo-core": "olmo-core.json", "levanter": "levanter.yaml", "marin": "levanter.yaml",
                "torchtitan": "torchtitan.toml"}


def _warmup_steps(spec: Spec) -> int:
    s = spec.schedule
    return int(s.warmup_steps if s.warmup_steps is not None else round(s.warmup_frac * spec.total_steps))


def _common_notes(spec: Spec) -> list[str]:
    s, out = spec.schedule, []
    if s.decay_end_frac < 1:
        out.append(f"schedule.decay_end_frac {s.decay_end_frac:g} (the stack's decay ends at the last step)")
    if s.rejoins:
        out.append(f"schedule.rejoins ({len(s.rejoins)}: the stack's schedule is one curve)")
    if s.cooldown_branches:
        out.append("schedule.cooldown_branches (launch each branch as its own run)")
    if spec.data.context_stages:
        out.append("data.context_stages (the stack's sequence length is one)")
    return out


def _olmo_core(cfg: dict, spec: Spec, resume_step: int | None) -> tuple[str, list[str]]:
    cfg, notes = copy.deepcopy(cfg), _common_notes(spec)
    s, peak, warm = spec.schedule, spec.optim.peak_lr, _warmup_steps(spec)
    trainer = cfg.setdefault("trainer", {})
    trainer["max_duration"] = {**(trainer.get("max_duration") or {}), "value": int(spec.data.total_tokens),
                               "unit": "tokens"}
    cfg.setdefault("data_loader", {})["global_batch_size"] = int(spec.data.tokens_per_step)
    tm = cfg.setdefault("train_module", {})
    tm.setdefault("optim", {})["lr"] = float(peak)
    # src/olmo_core/optim/scheduler.py: CosWithWarmup / LinearWithWarmup (warmup, alpha_f), WSD
    # (warmup, decay_fraction, decay_min_lr), ConstantWithWarmup (warmup)
    base = "olmo_core.optim.scheduler."
    if s.decay == "cosine":
        tm["scheduler"] = {"_CLASS_": base + "CosWithWarmup", "warmup": warm, "alpha_f": float(s.min_lr_ratio)}
    elif s.decay == "linear":
        tm["scheduler"] = {"_CLASS_": base + "LinearWithWarmup", "warmup": warm, "alpha_f": float(s.min_lr_ratio)}
    elif s.decay == "wsd":
        tm["scheduler"] = {"_CLASS_": base + "WSD", "warmup": warm,
                           "decay_fraction": round(1.0 - float(s.decay_start_frac or 0.8), 6),
                           "decay_min_lr": float(s.min_lr_ratio * peak)}
    else:
        tm["scheduler"] = {"_CLASS_": base + "ConstantWithWarmup", "warmup": warm}
    cfg["init_seed"] = int(spec.seed)
    if resume_step:
        folder = trainer.get("save_folder")
        if folder:
            trainer["load_path"] = f"{str(folder).rstrip('/')}/step{int(resume_step)}"
        else:
            notes.append(f"trainer.load_path (no save_folder here: load the checkpoint of step {resume_step})")
    if spec.data.phases:
        notes.append("data.phases (OLMo-core's mix is fixed for a run: start a new dataset mix at the phase)")
    return json.dumps(cfg, indent=2) + "\n", notes


def _levanter(cfg: dict, spec: Spec, resume_step: int | None) -> tuple[str, list[str]]:
    cfg, notes = copy.deepcopy(cfg), _common_notes(spec)
    s = spec.schedule
    tr = cfg.setdefault("trainer", {})
    tr["num_train_steps"] = int(spec.total_steps)
    tr["train_batch_size"] = int(spec.data.batch_size)
    tr["seed"] = int(spec.seed)
    cfg.setdefault("model", {})["seq_len"] = int(spec.data.seq_len)
    opt = cfg.setdefault("optimizer", {})
    opt["learning_rate"] = float(spec.optim.peak_lr)
    opt["min_lr_ratio"] = float(s.min_lr_ratio)
    # src/levanter/optim/config.py:117-130: warmup and decay as a fraction (<= 1) or steps
    opt["warmup"] = int(s.warmup_steps) if s.warmup_steps is not None else float(s.warmup_frac)
    opt.pop("decay", None)
    if s.decay == "wsd":
        opt.update({"lr_schedule": "linear", "decay": round(1.0 - float(s.decay_start_frac or 0.8), 6)})
    else:
        opt["lr_schedule"] = s.decay
    data = cfg.get("data") or {}
    if isinstance(data.get("configs"), dict):
        names = [src.name for src in spec.data.sources]
        base = {n: float(src.weight) for n, src in zip(names, spec.data.sources)}
        if spec.data.phases:  # src/levanter/data/text.py:1129 train_weights: [(step, {name: weight}), ...]
            stages = [[0, base]] + [[int(round(ph.start_frac * spec.total_steps)), {**base, **ph.weights}]
                                    for ph in spec.data.phases]
            data["train_weights"] = stages
        else:
            data["train_weights"] = base
    elif spec.data.phases:
        notes.append("data.phases (this config has one dataset, no mixture to re-weight)")
    if resume_step:
        notes.append(f"resume (Levanter resumes from the newest checkpoint under trainer.checkpointer.base_path; "
                     f"keep the one of step {resume_step})")
    return yaml.safe_dump(cfg, sort_keys=False), notes


def _torchtitan(cfg: dict, spec: Spec, resume_step: int | None, text: str | None) -> tuple[str, list[str]]:
    notes = _common_notes(spec)
    doc = tomlkit.parse(text) if text else tomlkit.document()
    if not text:
        for k, v in cfg.items():
            doc[k] = v
    s = spec.schedule

    def table(name: str):
        if name not in doc:
            doc[name] = tomlkit.table()
        return doc[name]

    tr = table("training")
    tr["steps"] = int(spec.total_steps)
    tr["global_batch_size"] = int(spec.data.batch_size)
    tr["seq_len"] = int(spec.data.seq_len)
    table("optimizer")["lr"] = float(spec.optim.peak_lr)
    sch = table("lr_scheduler")
    # torchtitan/config/job_config.py:169-200 (LRScheduler)
    sch["warmup_steps"] = _warmup_steps(spec)
    sch["min_lr_factor"] = float(s.min_lr_ratio)
    if s.decay == "wsd":
        sch["decay_ratio"] = round(1.0 - float(s.decay_start_frac or 0.8), 6)
        sch["decay_type"] = "linear"
    elif s.decay == "constant":
        sch["decay_ratio"] = 0.0
        notes.append("schedule.decay constant (decay_ratio 0: no decay phase)")
    else:
        if "decay_ratio" in sch:
            del sch["decay_ratio"]
        sch["decay_type"] = s.decay
    table("debug")["seed"] = int(spec.seed)
    if resume_step:
        table("checkpoint")["load_step"] = int(resume_step)  # job_config.py Checkpoint.load_step
    if spec.data.phases:
        notes.append("data.phases (torchtitan's dataset is one: start the phase's mix as a new dataset)")
    return tomlkit.dumps(doc), notes


def stack_form(stack: str, cfg: dict, spec: Spec, resume_step: int | None = None,
               text: str | None = None) -> tuple[str, list[str]]:
    """The file text of `spec` in `stack`'s form, from that stack's config `cfg` (`text`: the TOML as
    written, so its comments stay), and what it could not say."""
    if stack == "olmo-core":
        return _olmo_core(cfg, spec, resume_step)
    if stack in ("levanter", "marin"):
        return _levanter(cfg, spec, resume_step)
    if stack == "torchtitan":
        return _torchtitan(cfg, spec, resume_step, text)
    raise StackConfigError(f"no stack form for {stack!r} (known: {', '.join(STACK_SUFFIX)})")
