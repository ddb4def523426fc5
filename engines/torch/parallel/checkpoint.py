"""Sharded checkpoints of a mesh run (torch.distributed.checkpoint) and their export to the
engine-neutral format of engines/checkpoint.py.

Layout
------
    run_dir/sharded/step_{step:08d}/
        .metadata, __<rank>_0.distcp   written by every rank in parallel (its own shards only)
        state.json                     {"step", "tokens", "spec_id", "engine", "data", "mesh": {...}}

Keys: a parameter or buffer by its engine-neutral name; a routed-expert stack of expert shard e
as "<name>/ep<e>of<ep>" (each expert group holds other experts under the same module name);
"m/<key>" and "v/<key>" the AdamW moments, "optim_step" the updates done. The data dimension is
resharded by torch.distributed.checkpoint itself, so a run resumes from its sharded checkpoint
on any dp with the same model.ep_size; any other layout, or the other engine, continues from
the export.

Atomicity. Every rank writes into sharded/.tmp-step_X; after a barrier rank 0 adds state.json,
fsyncs, renames the directory to step_X and fsyncs its parent; only then are checkpoints beyond
the newest `keep` removed. A kill at any point leaves the complete new checkpoint or none.

    python -m engines.torch.parallel.checkpoint RUN_DIR [--step N]

exports a sharded checkpoint (default: the newest) to RUN_DIR/checkpoints/step_N
(model.safetensors, optim.safetensors, state.json), in one process, no process group needed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from engines.checkpoint import CheckpointError, _fsync_dir, _fsync_file, publish_dir, save_checkpoint, step_dir_name
from engines.torch.parallel.fsdp import _local_of, expert_slice, local_tensor, reshard
from engines.torch.parallel.layout import Layout
from engines.torch.parallel.model import is_expert_param

SHARDED = "sharded"
STATE_FILE = "state.json"
META_FILE = ".metadata"
EXPERT_KEY = re.compile(r"^(?P<name>.+)/ep(?P<e>\d+)of(?P<n>\d+)$")


def _key(name: str, mc: Layout) -> str:
    return f"{name}/ep{mc.e}of{mc.ep}" if is_expert_param(name) else name


def list_sharded(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / SHARDED
    if not root.is_dir():
        return []
    found = [(int(d.name[5:]), d) for d in root.iterdir()
             if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit()
             and (d / STATE_FILE).is_file() and (d / META_FILE).is_file()]
    return [d for _, d in sorted(found)]


def latest_sharded(run_dir: str | Path) -> Path | None:
    found = list_sharded(run_dir)
    return found[-1] if found else None


def read_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def _state_dict(model, opt, mc: Layout, fresh_moments: bool) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds, by key: the live parameters and moments (loaded in place)."""
    reshard(model)
    out: dict[str, torch.Tensor] = {}
    for name, b in model.named_buffers():
        out[name] = b
    for name, p in model.named_parameters():
        k = _key(name, mc)
        out[k] = p
        st = opt.state.get(p)
        if not st and fresh_moments:
            st = opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        if st:
            out[f"m/{k}"], out[f"v/{k}"] = st["exp_avg"], st["exp_avg_sq"]
    return out


def optimizer_step(opt) -> int:
    for st in opt.state.values():
        return int(st["step"])
    return 0


def save_sharded(run_dir: str | Path, step: int, model, opt, info: dict, mc: Layout, keep: int = 2) -> Path:
    """Every rank writes its shards of checkpoint `step`; rank 0 publishes it atomically."""
    root = Path(run_dir) / SHARDED
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if mc.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    sd = _state_dict(model, opt, mc, fresh_moments=True)
    sd["optim_step"] = torch.tensor(optimizer_step(opt), dtype=torch.int64)
    dcp.save(sd, checkpoint_id=str(tmp))
    dist.barrier()
    if mc.rank == 0:
        state = {**info, "step": int(step), "mesh": {"dp": mc.dp, "ep": mc.ep, "world": mc.world}}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True, default=float) + "\n")
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        publish_dir(tmp, final)
        for d in list_sharded(run_dir)[: -keep]:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    return final


def load_sharded(path: Path, model, opt, mc: Layout) -> dict:
    """Fill this rank's parameter and moment shards from a sharded checkpoint (in place; the data
    dimension may differ from the writer's). Returns its state.json."""
    state = read_state(path)
    if state.get("mesh", {}).get("ep") != mc.ep:
        raise CheckpointError(f"{path} was written with model.ep_size {state.get('mesh', {}).get('ep')}, "
                              f"this run has {mc.ep}: export it and continue from the export")
    sd = _state_dict(model, opt, mc, fresh_moments=True)
    sd["optim_step"] = torch.zeros((), dtype=torch.int64)
    try:
        dcp.load(sd, checkpoint_id=str(path))
    except Exception as err:
        raise CheckpointError(f"{path}: cannot read sharded checkpoint: {err}") from err
    step = int(sd["optim_step"])
    if step == 0:
        opt.state.clear()  # zero moments at step 0 are exactly a fresh optimizer
    else:
        for st in opt.state.values():
            st["step"] = torch.tensor(float(step))
    return state


def load_moments(model, opt, arrays: dict[str, np.ndarray], mc: Layout) -> None:
    """AdamW state from engine-neutral arrays ("m/<name>", "v/<name>", "step") into this rank's shards."""
    step = int(arrays.get("step", 0))
    if step == 0:
        return
    arrays = expert_slice(arrays, model.m, mc)
    for name, p in model.named_parameters():
        st = {"step": torch.tensor(float(step))}
        for src, dst in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            t = torch.zeros_like(p)
            a = arrays.get(f"{src}/{name}")
            if a is not None:
                local_tensor(t).copy_(_local_of(t, a))
            st[dst] = t
        opt.state[p] = st


# ---- export -------------------------------------------------------------------------------------


def read_full(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(params, AdamW arrays, state) of a sharded checkpoint in engine-neutral form, in one process."""
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{path}: not a sharded checkpoint: {err}") from err
    sd = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()
          if hasattr(md, "size")}
    with warnings.catch_warnings():  # one process on purpose: no process group to warn about
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    step = int(sd.pop("optim_step"))
    stacks: dict[str, dict[int, np.ndarray]] = {}
    flat: dict[str, np.ndarray] = {}
    for k, t in sd.items():
        m = EXPERT_KEY.match(k)
        if m:
            stacks.setdefault(m["name"], {})[int(m["e"])] = t.numpy()
        else:
            flat[k] = t.numpy()
    for name, parts in stacks.items():
        flat[name] = np.concatenate([parts[e] for e in sorted(parts)], 0)
    params = {k: a for k, a in flat.items() if not k.startswith(("m/", "v/"))}
    opt = {k: a for k, a in flat.items() if k.startswith(("m/", "v/"))}
    opt["step"] = np.asarray(step, np.int64)
    return params, opt, read_state(path)


def export(run_dir: str | Path, step: int | None = None, keep: int = 10**9) -> Path:
    """Write sharded checkpoint `step` (default: the newest) of run_dir as the engine-neutral
    run_dir/checkpoints/step_N; returns its path."""
    run_dir = Path(run_dir)
    found = list_sharded(run_dir)
    if step is not None:
        found = [d for d in found if int(d.name[5:]) == step]
    if not found:
        what = f"step {step}" if step is not None else "any step"
        raise CheckpointError(f"{run_dir} has no sharded checkpoint of {what} (looked in {run_dir / SHARDED})")
    params, opt, state = read_full(found[-1])
    state = {**state, "exported_from": str(found[-1].resolve())}
    state.pop("format", None)
    return save_checkpoint(run_dir, int(state.pop("step")), params, opt, state, keep=keep)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.torch.parallel.checkpoint",
                                description="export a sharded checkpoint to the engine-neutral format")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="default: the newest sharded checkpoint")
    args = p.parse_args(argv)
    try:
        out = export(args.run_dir, args.step)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
