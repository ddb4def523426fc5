"""Engine-neutral checkpoints (numpy in, numpy out: the torch and JAX engines share them).

Layout
------
    run_dir/checkpoints/step_{step:08d}/
        model.safetensors   parameters by the names of engines/base.py, float32
        optim.safetensors   AdamW state: "m/<param>" (first moment), "v/<param>" (second moment),
                            float32, and "step" (int64 scalar: optimizer updates done so far)
        state.json          {"step", "tokens", "spec_id", "engine", "data": {...}, ...}

`step` is the number of optimizer updates done: step_00000025 holds the weights after updates
0..24 and a resumed run continues with update 25 (metrics records are 0-based: the record of
step s is made by update s). Only parameters the optimizer trains have m/v entries (the router's
balancing bias is a buffer: it is in model.safetensors only).

AdamW state mapping. torch.optim.AdamW keeps state[p] = {"step", "exp_avg", "exp_avg_sq"};
optax.adamw keeps ScaleByAdamState(count, mu, nu). exp_avg == mu == "m/<param>",
exp_avg_sq == nu == "v/<param>", step == count == "step"; both bias-correct with 1 - beta^step
and apply decoupled weight decay lr * wd * p, so a checkpoint written by one engine resumes in
the other.

Atomicity. A checkpoint is written into checkpoints/.tmp-step_X-<pid>/, every file fsynced,
then the directory is renamed to step_X and the parent directory fsynced. A kill at any point
leaves either the complete new checkpoint or none (the older ones are untouched); only after the
rename are checkpoints beyond the newest `keep` removed. latest_checkpoint() only returns
directories that have all three files.

API
---
    save_checkpoint(run_dir, step, params, opt_state, state, keep=2) -> Path
    latest_checkpoint(run_dir) -> Path | None
    list_checkpoints(run_dir) -> list[Path]          (oldest first)
    load_checkpoint(path) -> (params, opt_state, state)
    init_from_checkpoint(run_dir, source, metrics_from=None) -> Path
        seed a new run dir with another run's checkpoint (the replan path: lineage.resume_step)
    remove_checkpoints(run_dir)                      (a fresh start: --no-resume)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
STATE_FILE = "state.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and says why."""


def warn_if_other_data(ckpt: Path, info: dict, fingerprint: str) -> None:
    """A resumed run whose checkpoint saw other data (changed source files) is not a replay: say so."""
    import warnings

    seen = (info.get("data") or {}).get("fingerprint")
    if seen and seen != fingerprint:
        warnings.warn(f"{ckpt} was trained on different data ({seen} != {fingerprint}): "
                      "the resumed run is not a replay", stacklevel=3)


def missing_parent_checkpoint(spec, run_dir) -> CheckpointError:
    """The error for a continuation (lineage.resume_step) whose run dir was never seeded."""
    return CheckpointError(
        f"spec {spec.name!r} continues run {spec.lineage.parent_id} from step {spec.lineage.resume_step} "
        f"(lineage.resume_step) but {run_dir} has no checkpoint; seed it with "
        f"engines.checkpoint.init_from_checkpoint(run_dir, <parent run>/checkpoints/step_N)"
    )


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _is_complete(d: Path) -> bool:
    return all((d / f).is_file() for f in (MODEL_FILE, OPTIM_FILE, STATE_FILE))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and _is_complete(d):
            found.append((int(d.name[5:]), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def _f32(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()}


def save_checkpoint(run_dir: str | Path, step: int, params: dict[str, np.ndarray],
                    opt_state: dict[str, np.ndarray], state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and keep the newest `keep` checkpoints.

    params: {name: array}; opt_state: {"m/<name>": array, "v/<name>": array, "step": int};
    state: JSON-able dict (step is filled in)."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(_f32(params), str(tmp / MODEL_FILE), metadata={"format": str(FORMAT_VERSION)})
        moments = _f32({k: v for k, v in opt_state.items() if k != "step"})
        bad = [k for k in moments if not k.startswith(("m/", "v/"))]
        if bad:
            raise CheckpointError(f"optimizer state keys must be 'm/<param>', 'v/<param>' or 'step' (got {bad})")
        moments["step"] = np.asarray(int(opt_state.get("step", step)), dtype=np.int64)
        save_file(moments, str(tmp / OPTIM_FILE), metadata={"format": str(FORMAT_VERSION)})
        state = {**state, "step": int(step), "format": FORMAT_VERSION}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True, default=float) + "\n")
        for f in (MODEL_FILE, OPTIM_FILE, STATE_FILE):
            _fsync_file(tmp / f)
        _fsync_dir(tmp)
        if final.exists():  # an older write of the same step (a run restarted before it): replace it
            old = root / f".old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    ckpts = list_checkpoints(root.parent)
    for d in ckpts[: max(len(ckpts) - keep, 0)]:
        shutil.rmtree(d, ignore_errors=True)
    for d in root.iterdir():  # leftovers of writers killed mid-write
        if d.name.startswith((".tmp-", ".old-")):
            try:
                pid = int(d.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if pid == os.getpid() or not _alive(pid):
                shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(params, opt_state, state) of a checkpoint directory; opt_state["step"] is an int64 scalar."""
    path = Path(path)
    if not path.is_dir() or not _is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (needs {MODEL_FILE}, {OPTIM_FILE}, {STATE_FILE})")
    try:
        params = load_file(str(path / MODEL_FILE))
        opt = load_file(str(path / OPTIM_FILE))
        state = json.loads((path / STATE_FILE).read_text())
    except Exception as err:  # safetensors raises its own error type for a damaged file
        raise CheckpointError(f"{path}: cannot read checkpoint: {err}") from err
    return params, opt, state


def remove_checkpoints(run_dir: str | Path) -> None:
    shutil.rmtree(Path(run_dir) / CHECKPOINTS, ignore_errors=True)


def init_from_checkpoint(run_dir: str | Path, source: str | Path, metrics_from: str | Path | None = None) -> Path:
    """Seed `run_dir` with the checkpoint directory `source` (e.g. a parent run's
    checkpoints/step_00001000) so that train(spec, run_dir, resume=True) continues from it; this
    is how a replan (spec.lineage.resume_step, parent_id) starts. The copy is atomic. With
    `metrics_from` (the parent's run dir) its metrics records below that step are copied too, so
    the child's metrics.jsonl is one continuous curve. Idempotent: a run dir that already has a
    checkpoint at or past that step is left alone."""
    from engines.base import METRICS_FILE
    from core.fsutil import atomic_write_text

    source = Path(source)
    params, opt, state = load_checkpoint(source)  # validates before anything is written
    step = int(state["step"])
    latest = latest_checkpoint(run_dir)
    if latest is not None and int(latest.name[5:]) >= step:
        return latest
    if metrics_from is not None:
        src_metrics = Path(metrics_from) / METRICS_FILE
        lines = []
        if src_metrics.exists():
            for line in src_metrics.read_text().splitlines():
                try:
                    if json.loads(line).get("step", step) < step:
                        lines.append(line)
                except json.JSONDecodeError:
                    continue
        atomic_write_text(Path(run_dir) / METRICS_FILE, "".join(l + "\n" for l in lines))
    state = {**state, "initialised_from": str(source.resolve())}
    return save_checkpoint(run_dir, step, params, opt, state, keep=10**9)
