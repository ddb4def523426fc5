"""Engine-neutral checkpoints (numpy in, numpy out: the torch and JAX engines share them).

Layout
------
    run_dir/checkpoints/step_{step:08d}/
        model.safetensors   parameters by the names of engines/base.py, float32
        optim.safetensors   AdamW state: "m/<param>" (first moment), "v/<param>" (second moment),
                            float32, and "step" (int64 scalar: optimizer updates done so far)
        state.json          {"step", "tokens", "spec_id", "engine", "data": {...}, "options": {...},
                             "sha256": {"model.safetensors": ..., "optim.safetensors": ...}, ...}

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

Integrity. Each array file's sha256 is recorded in state.json as it is saved, and state.json's own
content is sealed by "state_sha256" (the sha256 of its canonical JSON without that key), so an edit
to its step or tokens is caught as surely as a flipped byte in the arrays. Both are checked before
a run resumes from it (verify_checkpoint; load_checkpoint by default). A damaged checkpoint is never
resumed from: newest_intact_checkpoint() moves it aside (checkpoints/damaged-step_X-<time>) and
names the newest intact one. Checkpoints written before checksums were recorded load unverified.

Space. save_checkpoint checks the free space of the file system first (the arrays' size is
known): with too little, or when a write fails for want of space, it raises CheckpointSpaceError
and the checkpoints already there are untouched.

API
---
    save_checkpoint(run_dir, step, params, opt_state, state, keep=2) -> Path
    write_checkpoint(root, step, state, backend, keep) -> Path
        the one transaction (temporary directory, checksums, sealed state.json, fsync, rename,
        prune) around a backend's files: ArrayFiles here, the mesh's sharded files in
        engines/torch/parallel/checkpoint.py
    latest_checkpoint(run_dir) -> Path | None
    list_checkpoints(run_dir) -> list[Path]          (oldest first)
    verify_checkpoint(path) -> dict                  (its state; CheckpointError if damaged)
    newest_intact_checkpoint(run_dir, warn) -> Path | None
    resume_step(run_dir) -> int                      (the step a resumed run starts from)
    load_checkpoint(path, verify=True) -> (params, opt_state, state)
    init_from_checkpoint(run_dir, source, metrics_from=None) -> Path
        seed a new run dir with another run's checkpoint (the replan path: lineage.resume_step)
    remove_checkpoints(run_dir)                      (a fresh start: --no-resume)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from core.errors import InputError
from core.fsutil import atomic_write_text, file_mode
from core.rundir import METRICS_FILE, RunDir

CHECKPOINTS = "checkpoints"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
STATE_FILE = "state.json"
STATE_SUM = "state_sha256"
FORMAT_VERSION = 1


SPACE_MARGIN = 1 << 20  # bytes kept free beyond a checkpoint's arrays (headers, state.json)
RECOVERY_HINT = ("move that checkpoint directory aside to resume from an older one, restore it from a copy, "
                 "or start the run over with --no-resume")


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message names it and says why."""


class CheckpointSpaceError(CheckpointError):
    """Too little free space to write a checkpoint; the checkpoints already there are kept."""


def warn_if_other_data(ckpt: Path, info: dict, fingerprint: str) -> None:
    """A resumed run whose checkpoint saw other data (changed source files) is not a replay: say so."""

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



def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written (and fsynced) directory into place; an older write of the same name
    (a run restarted before it) is replaced. Readers see the old directory or the new one."""
    root = final.parent
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)

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


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _state_digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != STATE_SUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_state(state: dict) -> dict:
    """`state` as it will read back from JSON, with STATE_SUM over the rest of it."""
    plain = json.loads(json.dumps({k: v for k, v in state.items() if k != STATE_SUM}, default=float))
    return {**plain, STATE_SUM: _state_digest(plain)}


def write_state(path: Path, state: dict) -> dict:
    """Write `state`, sealed (seal_state), as path/state.json; returns what was written."""
    state = seal_state(state)
    (path / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    return state


def check_sealed(path: Path, state: dict, needed: tuple[str, ...] = ()) -> None:
    """CheckpointError unless state.json's content and every file whose sha256 it records are as
    saved (a checkpoint from before checksums has none to check). `needed`: files that must be among
    the recorded ones when any are."""
    want_state = state.get(STATE_SUM)
    if want_state is not None and want_state != _state_digest(state):
        raise CheckpointError(f"{path}: {STATE_FILE} was changed after it was saved (its content no longer matches "
                              f"the {STATE_SUM} recorded with it); {RECOVERY_HINT}")
    sums = state.get("sha256")
    if sums is None:
        return
    unsummed = [n for n in needed if n not in sums] if isinstance(sums, dict) else list(needed)
    if not isinstance(sums, dict) or unsummed:
        raise CheckpointError(f"{path}: {STATE_FILE} records no checksum of {', '.join(unsummed) or 'its files'}; "
                              f"{RECOVERY_HINT}")
    for name, want in sums.items():
        f = path / name
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{path}: {STATE_FILE} names {name!r}, which is not a file of the checkpoint; {RECOVERY_HINT}")
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing (it was saved with sha256 {str(want)[:12]}...); {RECOVERY_HINT}")
        got = sha256_file(f)
        if got != want:
            raise CheckpointError(f"{path}: {name} is damaged (its sha256 {got[:12]}... differs from the "
                                  f"{str(want)[:12]}... recorded when it was saved); {RECOVERY_HINT}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _space_error(root: Path, step: int, need: int, free: int | None) -> CheckpointSpaceError:
    prev = latest_checkpoint(root.parent)
    kept = f"the previous checkpoint ({prev}) is kept" if prev else "no earlier checkpoint exists"
    have = f", {_human(free)} free" if free is not None else ""
    return CheckpointSpaceError(f"no space for checkpoint step {step} in {root}: it needs about {_human(need)}{have}; "
                                f"{kept}; free some space and run again to resume")


def check_space(root: Path, step: int, need: int) -> None:
    """CheckpointSpaceError unless the file system of `root` has `need` bytes (plus a margin) free."""
    free = shutil.disk_usage(root).free
    if free < need + SPACE_MARGIN:
        raise _space_error(root, step, need + SPACE_MARGIN, free)


class CheckpointBackend:
    """How a checkpoint's files are written into its directory: by one process (ArrayFiles) or by
    every rank of a mesh, each its own shards (engines/torch/parallel/checkpoint.py's DCP backend).
    write_checkpoint runs the one transaction around it."""

    lead = True  # this process names, seals, publishes and prunes

    def tmp_name(self, final: Path) -> str:
        """The directory written into (every process of one checkpoint agrees on it)."""
        return f".tmp-{final.name}-{os.getpid()}"

    def barrier(self) -> None:
        """Wait for every process writing this checkpoint (none but this one here)."""

    def write(self, tmp: Path) -> None:
        raise NotImplementedError

    def digests(self, tmp: Path) -> dict[str, str]:
        """{file: sha256} of every file written, on the lead (each process may hash a share)."""
        return {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}

    def prune(self, root: Path, keep: int) -> None:
        raise NotImplementedError


class ArrayFiles(CheckpointBackend):
    """The engine-neutral format: model.safetensors and optim.safetensors from one process."""

    def __init__(self, model: dict[str, np.ndarray], moments: dict[str, np.ndarray]):
        self.model, self.moments = model, moments

    def write(self, tmp: Path) -> None:
        save_file(self.model, str(tmp / MODEL_FILE), metadata={"format": str(FORMAT_VERSION)})
        save_file(self.moments, str(tmp / OPTIM_FILE), metadata={"format": str(FORMAT_VERSION)})
        for f in (MODEL_FILE, OPTIM_FILE):  # safetensors writes 0600; every other run file has open()'s mode
            os.chmod(tmp / f, file_mode())

    def prune(self, root: Path, keep: int) -> None:
        _prune(root, keep)


def write_checkpoint(root: Path, step: int, state: dict, backend: CheckpointBackend, keep: int) -> Path:
    """The one checkpoint transaction, whatever writes the files: into root/.tmp-step_X, the
    backend's files (every process its part), their sha256 and the sealed state.json, every file
    and the directory fsynced, renamed to root/step_X, its parent fsynced; only then are
    checkpoints beyond the newest `keep` removed. A kill at any point leaves the complete new
    checkpoint or none; a failure removes the partial directory and goes on."""
    final = root / step_dir_name(step)
    tmp = root / backend.tmp_name(final)
    if backend.lead:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    backend.barrier()
    try:
        backend.write(tmp)
        backend.barrier()
        sums = backend.digests(tmp)
        if backend.lead:
            write_state(tmp, {**state, "step": int(step), "sha256": sums})
            for f in tmp.iterdir():
                _fsync_file(f)
            _fsync_dir(tmp)
            publish_dir(tmp, final)
    except BaseException:  # any failure, Ctrl-C included: the partial directory goes, the error goes on
        if backend.lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if backend.lead:
        backend.prune(root, keep)
    backend.barrier()
    return final


def save_checkpoint(run_dir: str | Path, step: int, params: dict[str, np.ndarray],
                    opt_state: dict[str, np.ndarray], state: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically (write_checkpoint with the ArrayFiles backend) and keep
    the newest `keep` checkpoints.

    params: {name: array}; opt_state: {"m/<name>": array, "v/<name>": array, "step": int};
    state: JSON-able dict (step is filled in)."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    model = _f32(params)
    moments = _f32({k: v for k, v in opt_state.items() if k != "step"})
    bad = [k for k in moments if not k.startswith(("m/", "v/"))]
    if bad:
        raise CheckpointError(f"optimizer state keys must be 'm/<param>', 'v/<param>' or 'step' (got {bad})")
    moments["step"] = np.asarray(int(opt_state.get("step", step)), dtype=np.int64)
    need = sum(a.nbytes for a in model.values()) + sum(a.nbytes for a in moments.values())
    check_space(root, step, need)
    try:
        return write_checkpoint(root, step, {**state, "format": FORMAT_VERSION}, ArrayFiles(model, moments), keep)
    except BaseException as err:
        if _no_space(err):
            raise _space_error(root, step, need + SPACE_MARGIN, None) from err
        raise


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


def _no_space(err: BaseException) -> bool:
    """A write that failed for want of space (safetensors reports it as its own error type)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(err) or "Disk quota exceeded" in str(err)


def _read_state(path: Path) -> dict:
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read {STATE_FILE} ({err}); {RECOVERY_HINT}") from err
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path}: {STATE_FILE} is not a checkpoint's state; {RECOVERY_HINT}")
    return state


def verify_checkpoint(path: str | Path) -> dict:
    """The checkpoint's state after checking every array file against the sha256 recorded at save
    (a checkpoint from before checksums has none to check); CheckpointError names a damaged file."""
    path = Path(path)
    if not path.is_dir() or not _is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (needs {MODEL_FILE}, {OPTIM_FILE}, {STATE_FILE})")
    state = _read_state(path)
    check_sealed(path, state, needed=(MODEL_FILE, OPTIM_FILE))
    return state


def newest_intact(candidates: list[Path], verify: Callable[[Path], object], what: str,
                  warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest of `candidates` (oldest first) that `verify` passes. Each damaged one met on the
    way is moved aside (damaged-step_X-<time> beside it, never resumed from or counted again) and
    reported through `warn`, naming the one resumed from instead."""
    damaged: list[tuple[Path, str]] = []
    found = None
    for ckpt in reversed(candidates):
        try:
            verify(ckpt)
        except CheckpointError as err:
            damaged.append((ckpt, str(err).split("; ")[0]))
            continue
        found = ckpt
        break
    for ckpt, why in damaged:
        aside = ckpt.with_name(f"damaged-{ckpt.name}-{time.strftime('%Y%m%dT%H%M%S')}")
        shutil.move(ckpt, aside)
        if warn is not None:
            instead = f"resuming from the newest intact one, {found}" if found else f"no intact {what} is left"
            warn(f"{why}: moved aside to {aside}; {instead}")
    return found


def newest_intact_checkpoint(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that verifies (newest_intact: damaged ones are moved aside)."""
    return newest_intact(list_checkpoints(run_dir), verify_checkpoint, "checkpoint", warn)


def resume_step(run_dir: str | Path) -> int:
    """The step a resumed run of run_dir starts from: its newest intact checkpoint's (0 if none)."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            return int(verify_checkpoint(ckpt)["step"])
        except (CheckpointError, TypeError, ValueError):
            continue
    return 0


def load_checkpoint(path: str | Path, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(params, opt_state, state) of a checkpoint directory; opt_state["step"] is an int64 scalar.
    verify: check the files' checksums first (verify_checkpoint)."""
    path = Path(path)
    state = verify_checkpoint(path) if verify else None
    if not path.is_dir() or not _is_complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (needs {MODEL_FILE}, {OPTIM_FILE}, {STATE_FILE})")
    try:
        params = load_file(str(path / MODEL_FILE))
        opt = load_file(str(path / OPTIM_FILE))
    except (SafetensorError, OSError) as err:  # a damaged file (safetensors' own error type), an unreadable one
        raise CheckpointError(f"{path}: cannot read checkpoint: {err}; {RECOVERY_HINT}") from err
    return params, opt, state if state is not None else _read_state(path)


def remove_checkpoints(run_dir: str | Path) -> None:
    shutil.rmtree(Path(run_dir) / CHECKPOINTS, ignore_errors=True)


def _before(rec: dict, step: int) -> bool:
    s = rec.get("step")
    return isinstance(s, int) and not isinstance(s, bool) and s < step


def init_from_checkpoint(run_dir: str | Path, source: str | Path, metrics_from: str | Path | None = None) -> Path:
    """Seed `run_dir` with the checkpoint directory `source` (e.g. a parent run's
    checkpoints/step_00001000) so that train(spec, run_dir, resume=True) continues from it; this
    is how a replan (spec.lineage.resume_step, parent_id) starts. The copy is atomic. With
    `metrics_from` (the parent's run dir) its metrics records below that step are copied too, so
    the child's metrics.jsonl is one continuous curve. Idempotent: a run dir that already has a
    checkpoint at or past that step is left alone."""
    source = Path(source)
    params, opt, state = load_checkpoint(source)  # validates before anything is written
    step = int(state["step"])
    latest = latest_checkpoint(run_dir)
    if latest is not None and int(latest.name[5:]) >= step:
        return latest
    if metrics_from is not None:
        kept = [r for r in RunDir(metrics_from).read_metrics() if _before(r, step)]  # bad lines: warned, skipped
        atomic_write_text(Path(run_dir) / METRICS_FILE, "".join(json.dumps(r, allow_nan=True) + "\n" for r in kept))
    state = {**state, "initialised_from": str(source.resolve())}
    return save_checkpoint(run_dir, step, params, opt, state, keep=10**9)
