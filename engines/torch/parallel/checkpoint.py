"""Sharded checkpoints of a mesh run (torch.distributed.checkpoint) and their export to the
engine-neutral format of engines/checkpoint.py.

Layout
------
    run_dir/sharded/step_{step:08d}/
        .metadata, __<rank>_0.distcp   written by every rank in parallel (its own shards only)
        state.json                     {"step", "tokens", "spec_id", "engine", "data", "mesh": {...},
                                        "sha256": {file: digest}, "state_sha256"}

Keys: a parameter or buffer by its engine-neutral name; a routed-expert stack of expert shard e
as "<name>/ep<e>of<ep>" (each expert group holds other experts under the same module name);
"m/<key>" and "v/<key>" the AdamW moments, "optim_step" the updates done. The data dimension is
resharded by torch.distributed.checkpoint itself, so a run resumes from its sharded checkpoint
on any dp with the same model.ep_size; any other layout, or the other engine, continues from
the export.

Atomicity. The one transaction of engines/checkpoint.write_checkpoint with this module's backend
(ShardedFiles): every rank writes into sharded/.tmp-step_X; after a barrier rank 0 adds state.json,
fsyncs, renames the directory to step_X and fsyncs its parent; only then are checkpoints beyond
the newest `keep` removed. A kill at any point leaves the complete new checkpoint or none.

Integrity. After the shards are written every rank hashes a share of the directory's files, and
rank 0 records each file's sha256 in state.json, sealed as the engine-neutral state.json is
(engines/checkpoint.py: seal_state). A run resumes only from a checkpoint that verifies
(newest_intact_sharded moves a damaged one aside to sharded/damaged-step_X-<time> and names the
one resumed from instead), and export refuses a damaged, truncated or incomplete one in one line.
Checkpoints written before checksums were recorded load unverified.

Safety. torch's reader unpickles .metadata; here it is read by SafeReader, whose unpickler knows
only the few classes a checkpoint's metadata holds (tensor storage descriptions, torch.Size,
dtypes) and refuses anything else, so a crafted .metadata cannot run code even where no checksum
is recorded, and a checkpoint whose metadata describes non-tensor entries (which torch would
unpickle with torch.load) is refused.

    python -m engines.torch.parallel.checkpoint RUN_DIR [--step N]

exports a sharded checkpoint (default: the newest) to RUN_DIR/checkpoints/step_N
(model.safetensors, optim.safetensors, state.json), in one process, no process group needed.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import pickle
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint import FileSystemReader

from engines.checkpoint import (
    CheckpointBackend,
    CheckpointError,
    check_sealed,
    newest_intact,
    save_checkpoint,
    sha256_file,
    write_checkpoint,
)
from engines.torch.parallel.fsdp import _local_of, expert_slice, local_tensor, reshard
from engines.torch.parallel.layout import Layout
from engines.torch.parallel.model import is_expert_param
from engines.torch.parallel.sharded import SHARDED, STATE_FILE, latest_sharded, list_sharded

META_FILE = ".metadata"
EXPERT_KEY = re.compile(r"^(?P<name>.+)/ep(?P<e>\d+)of(?P<n>\d+)$")


def _key(name: str, mc: Layout) -> str:
    return f"{name}/ep{mc.e}of{mc.ep}" if is_expert_param(name) else name


def read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read {STATE_FILE} ({err})") from err
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path}: {STATE_FILE} is not a sharded checkpoint's state")
    return state


def verify_sharded(path: Path) -> dict:
    """The checkpoint's state after checking state.json's seal and every file against the sha256
    recorded at save (CheckpointError names a missing, truncated or changed file)."""
    path = Path(path)
    state = read_state(path)
    if not (path / META_FILE).is_file():
        raise CheckpointError(f"{path}: {META_FILE} is missing; not a complete sharded checkpoint")
    check_sealed(path, state, needed=(META_FILE,))
    return state


def newest_intact_sharded(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest sharded checkpoint that verifies (engines.checkpoint.newest_intact: damaged ones
    are moved aside to sharded/damaged-step_X-<time>)."""
    return newest_intact(list_sharded(run_dir), verify_sharded, "sharded checkpoint", warn)


# what a sharded checkpoint's .metadata may name: torch's descriptions of tensor storage and nothing else
_META_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _META_CLASSES.get(module, ()):
            return getattr({"torch.distributed.checkpoint.metadata": dcp_md,
                            "torch.distributed.checkpoint.filesystem": dcp_fs,
                            "torch.serialization": torch.serialization, "torch": torch, "pathlib": pathlib,
                            "collections": collections}[module], name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a sharded checkpoint's metadata never holds")


class SafeReader(FileSystemReader):
    """torch's FileSystemReader with .metadata read through an allow-list unpickler (see Safety)."""

    def read_metadata(self, *args, **kwargs) -> dcp_md.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as err:
            raise CheckpointError(f"{path}: refused, not read ({err})") from err
        if not isinstance(metadata, dcp_md.Metadata) or not all(
                isinstance(md, dcp_md.TensorStorageMetadata) for md in metadata.state_dict_metadata.values()):
            raise CheckpointError(f"{path}: refused: it describes entries that are not tensors")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
            st = opt.state[p] = {"step": step_tensor(opt, p, 0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        if st:
            out[f"m/{k}"], out[f"v/{k}"] = st["exp_avg"], st["exp_avg_sq"]
    return out


def step_tensor(opt, p, step: int) -> torch.Tensor:
    """AdamW's step count for parameter p as the optimizer itself would hold it: on p's device in
    fp32 for the fused kernel (which reads it there), a CPU scalar otherwise."""
    if opt.defaults.get("fused"):
        return torch.tensor(float(step), dtype=torch.float32, device=p.device)
    return torch.tensor(float(step))


def optimizer_step(opt) -> int:
    for st in opt.state.values():
        return int(st["step"])
    return 0


class ShardedFiles(CheckpointBackend):
    """The mesh's backend of write_checkpoint: torch.distributed.checkpoint's shards, every rank
    its own; every rank hashes a share of the files; rank 0 seals, publishes and prunes."""

    def __init__(self, model, opt, mc: Layout):
        self.model, self.opt, self.mc = model, opt, mc
        self.lead = mc.rank == 0

    def tmp_name(self, final: Path) -> str:
        return f".tmp-{final.name}"  # one name for every rank

    def barrier(self) -> None:
        dist.barrier()

    def write(self, tmp: Path) -> None:
        sd = _state_dict(self.model, self.opt, self.mc, fresh_moments=True)
        sd["optim_step"] = torch.tensor(optimizer_step(self.opt), dtype=torch.int64)
        dcp.save(sd, checkpoint_id=str(tmp))

    def digests(self, tmp: Path) -> dict[str, str]:
        names = sorted(f.name for f in tmp.iterdir() if f.is_file())
        parts: list = [None] * self.mc.world
        dist.all_gather_object(parts, {n: sha256_file(tmp / n) for n in names[self.mc.rank::self.mc.world]})
        return {n: d for part in parts for n, d in part.items()}

    def prune(self, root: Path, keep: int) -> None:
        for d in list_sharded(root.parent)[: -keep]:
            shutil.rmtree(d, ignore_errors=True)


def save_sharded(run_dir: str | Path, step: int, model, opt, info: dict, mc: Layout, keep: int = 2) -> Path:
    """Every rank writes its shards of checkpoint `step`; rank 0 publishes it atomically
    (engines/checkpoint.write_checkpoint, the one transaction every checkpoint goes through)."""
    mesh = {"dp": mc.dp, "ep": mc.ep, "world": mc.world}
    return write_checkpoint(Path(run_dir) / SHARDED, step, {**info, "mesh": mesh}, ShardedFiles(model, opt, mc), keep)


def load_sharded(path: Path, model, opt, mc: Layout, verify: bool = True) -> dict:
    """Fill this rank's parameter and moment shards from a sharded checkpoint (in place; the data
    dimension may differ from the writer's). Returns its state.json. verify: check its checksums
    first (verify_sharded; a run's lead does so for every rank as it picks the checkpoint)."""
    state = verify_sharded(path) if verify else read_state(path)
    if state.get("mesh", {}).get("ep") != mc.ep:
        raise CheckpointError(f"{path} was written with model.ep_size {state.get('mesh', {}).get('ep')}, "
                              f"this run has {mc.ep}: export it and continue from the export")
    sd = _state_dict(model, opt, mc, fresh_moments=True)
    sd["optim_step"] = torch.zeros((), dtype=torch.int64)
    try:
        dcp.load(sd, storage_reader=SafeReader(str(path)))
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path}: cannot read sharded checkpoint: {err}") from err
    step = int(sd["optim_step"])
    if step == 0:
        opt.state.clear()  # zero moments at step 0 are exactly a fresh optimizer
    else:
        for param, st in opt.state.items():
            st["step"] = step_tensor(opt, param, step)
    return state


def load_moments(model, opt, arrays: dict[str, np.ndarray], mc: Layout) -> None:
    """AdamW state from engine-neutral arrays ("m/<name>", "v/<name>", "step") into this rank's shards."""
    step = int(arrays.get("step", 0))
    if step == 0:
        return
    arrays = expert_slice(arrays, model.m, mc)
    for name, p in model.named_parameters():
        st = {"step": step_tensor(opt, p, step)}
        for src, dst in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            t = torch.zeros_like(p)
            a = arrays.get(f"{src}/{name}")
            if a is not None:
                local_tensor(t).copy_(_local_of(t, a))
            st[dst] = t
        opt.state[p] = st


# ---- export -------------------------------------------------------------------------------------


def read_full(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(params, AdamW arrays, state) of a sharded checkpoint in engine-neutral form, in one process,
    after verifying it (verify_sharded)."""
    state = verify_sharded(path)
    meta = SafeReader(str(path)).read_metadata()
    sd = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in meta.state_dict_metadata.items()}
    if "optim_step" not in sd:
        raise CheckpointError(f"{path}: not a checkpoint of a mesh run (no optim_step)")
    try:
        with warnings.catch_warnings():  # one process on purpose: no process group to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, storage_reader=SafeReader(str(path)), no_dist=True)
    except CheckpointError:
        raise
    except Exception as err:  # torch's reader on a file damaged where no checksum was recorded
        raise CheckpointError(f"{path}: cannot read sharded checkpoint: {type(err).__name__}: "
                              f"{str(err).strip().splitlines()[-1] if str(err).strip() else ''}") from err
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
    return params, opt, state


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
