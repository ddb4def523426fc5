"""What is done: the ledger of runs on disk, and the claims that keep a spec on one worker.

Layout under the ladder root (`.ladder/` in the working directory, or --root / $MOE_LADDER_ROOT):

    mlflow.db                                   embedded MLflow store (created by the controller)
    runs/<experiment>/<spec.name>-<spec.id>/    one run dir per spec
        spec.yaml                               written by the controller
        metrics.jsonl  status.json  checkpoints/    written by the engine
        tracking.json                           MLflow run id and last uploaded step, per store
        locks/<spec.id>.lock                    the claim of the process training that spec there
    locks/stop-<submission>                     a submission's request that its workers stop

A claim lives in the run dir it guards, so every writer of a run dir (a submission's worker, a
`ladder train` of the same spec and run dir) takes the same one.

The run dir is the source of truth; MLflow is a view of it that `ladder sync` can rebuild.

Claims. A claim is a lock file created atomically (write a temp file, then hard-link it to the
lock name: the link fails if the name exists, and the content is complete the moment it appears).
It holds host, pid, the pid's start time, the owning submission and a random token; its mtime is
the heartbeat, refreshed by the worker every few seconds. A claim is dead, and may be broken, when
its heartbeat is older than the stale limit ($MOE_LADDER_LIMITS claim_stale_s, default 120 s: a holder on any
host that stopped), or at once when its holder ran on this host and that process is gone (pid no
longer alive, a zombie, or a different process under a reused pid). A submission also takes over
its own claims: it resubmits a spec only after Ray reported the previous attempt dead. Breaking a
lock happens under a short-lived break mutex and re-checks the token, so two breakers cannot both
win. Plain files rather than flock: they work across hosts on a shared filesystem and survive NFS,
where advisory locks are unreliable. A holder that finds its lock taken over stops training.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from core import env
from core.rundir import METRICS_FILE, SPEC_FILE, RunDir
from engines.base import read_status
from core.fsutil import atomic_write_json, atomic_write_text
from ladder.errors import LadderError
from core.spec import SpecError, load_spec
from ladder.experiment import Experiment, load_experiment

if TYPE_CHECKING:
    import pandas as pd

    from core.spec import Spec

TRACKING_FILE = "tracking.json"
STATES = ("pending", "running", "finished", "failed", "diverged")


# ---- paths ---------------------------------------------------------------------------------
def ladder_root(root: str | Path | None = None) -> Path:
    """--root, else $MOE_LADDER_ROOT, else ./.ladder; always absolute (workers run elsewhere)."""
    chosen = root or env.text("ROOT") or ".ladder"
    path = Path(chosen).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise LadderError(f"ladder root {path} is a file, not a directory (--root or $MOE_LADDER_ROOT)")
    return path


def runs_dir(root: str | Path) -> Path:
    return Path(root) / "runs"


def locks_dir(root: str | Path) -> Path:
    return Path(root) / "locks"


def inside(root: str | Path, *parts: str) -> Path:
    """root / parts, refused (LadderError) unless it resolves to a path strictly inside root: a name
    in a path the ledger builds can never reach a parent directory or another experiment's runs."""
    base = Path(root).resolve()
    path = Path(root).joinpath(*parts)
    bad_part = any(p in ("", ".", "..") or "/" in p or "\\" in p for p in parts)
    if bad_part or not path.resolve().is_relative_to(base) or path.resolve() == base:
        raise LadderError(f"refused: {'/'.join(parts)!r} does not stay inside {base}")
    return path


def run_dir_for(root: str | Path, experiment: str, spec: "Spec") -> Path:
    return inside(runs_dir(root), experiment, f"{spec.name}-{spec.id}")


def write_spec_file(run_dir: Path, spec: "Spec") -> None:
    """spec.yaml of a run dir; rewritten only when it differs (run arguments may change)."""
    path = Path(run_dir) / SPEC_FILE
    text = spec.to_yaml()
    if not path.exists() or path.read_text() != text:
        atomic_write_text(path, text)


# ---- run state -----------------------------------------------------------------------------
def last_metrics(run_dir: str | Path) -> dict | None:
    """The last complete record of metrics.jsonl with an integer step, read from the file's end
    (cheap on long runs)."""
    rec = RunDir(run_dir).last_metrics()
    step = None if rec is None else rec.get("step")
    return rec if isinstance(step, int) and not isinstance(step, bool) else None


def final_step(spec: "Spec") -> int:
    """The step of a run's last record: steps count from 0 to total_steps - 1."""
    return spec.total_steps - 1


def is_finished(run_dir: str | Path, spec: "Spec") -> bool:
    """Finished = the engine said so and the final step's metrics are on disk."""
    if read_status(run_dir).get("state") != "finished":
        return False
    last = last_metrics(run_dir)
    return last is not None and int(last.get("step", -1)) >= final_step(spec)


@dataclass
class RunRecord:
    experiment: str
    name: str
    role: str
    spec_id: str
    engine: str
    state: str
    step: int | None
    total_steps: int
    loss: float | None
    tokens_per_s: float | None
    run_dir: str
    mlflow_run_id: str | None = None
    detail: str = ""
    holder: str = ""


def run_record(root: Path, experiment: str, spec: "Spec", run_dir: Path, tracking_uri: str | None = None) -> RunRecord:
    status = read_status(run_dir)
    last = last_metrics(run_dir)
    state = status.get("state", "pending")
    detail = str(status.get("reason") or status.get("error") or "")
    holder = live_claim(root, spec.id)
    if holder is not None:
        state = "running"  # a live claim is stronger evidence than a status a dead worker left
    elif state == "running":
        # the engine said running but nobody holds the spec: the worker died or was interrupted
        state, detail = "failed", f"interrupted at step {last['step'] if last else 0}; resubmit resumes it"
    elif state == "finished" and not is_finished(run_dir, spec):
        state, detail = "failed", "status says finished but the final metrics are missing"
    if state not in STATES:
        detail, state = f"engine state {state!r}", "failed"
    track = read_tracking(run_dir)
    run_id = None
    if tracking_uri and tracking_uri in track:
        run_id = track[tracking_uri].get("run_id")
    elif len(track) == 1:
        run_id = next(iter(track.values())).get("run_id")
    return RunRecord(
        experiment=experiment,
        name=spec.name,
        role=spec.role,
        spec_id=spec.id,
        engine=spec.engine,
        state=state,
        step=None if last is None else int(last["step"]),
        total_steps=spec.total_steps,
        loss=None if last is None else last.get("loss"),
        tokens_per_s=None if last is None else last.get("tokens_per_s"),
        run_dir=str(run_dir),
        mlflow_run_id=run_id,
        detail=detail,
        holder="" if holder is None else f"{holder.get('host')}:{holder.get('pid')}",
    )


def iter_run_dirs(root: Path, experiment: str | None = None) -> Iterable[tuple[str, Path]]:
    base = runs_dir(root)
    exps = [experiment] if experiment else sorted(p.name for p in base.glob("*") if p.is_dir())
    for exp in exps:
        for d in sorted(inside(base, exp).glob("*")):
            if (d / SPEC_FILE).exists():
                yield exp, d


def records(
    root: str | Path | None = None,
    experiment: "str | Path | Experiment | None" = None,
    tracking_uri: str | None = None,
) -> list[RunRecord]:
    """One record per spec: the run dirs under root, plus the specs of an experiment file that
    have no run dir yet (pending). `experiment` is a name, an experiment file or an Experiment."""
    root = ladder_root(root)
    exp_obj = as_experiment(experiment)
    name = exp_obj.name if exp_obj is not None else (str(experiment) if experiment else None)
    out: list[RunRecord] = []
    seen: set[Path] = set()
    if exp_obj is not None:
        for spec in exp_obj.all_specs():
            d = run_dir_for(root, exp_obj.name, spec)
            seen.add(d)
            out.append(run_record(root, exp_obj.name, spec, d, tracking_uri))
    for exp, d in iter_run_dirs(root, name):
        if d in seen:
            continue
        try:
            spec = load_spec(d / SPEC_FILE)
        except SpecError as err:  # a hand-edited or foreign dir: show it, do not crash the table
            out.append(
                RunRecord(exp, d.name, "?", "?", "?", "failed", None, 0, None, None, str(d), detail=f"unreadable spec: {err}")
            )
            continue
        out.append(run_record(root, exp, spec, d, tracking_uri))
    return out


def runs_frame(
    root: str | Path | None = None,
    experiment: "str | Path | Experiment | None" = None,
    tracking_uri: str | None = None,
) -> "pd.DataFrame":
    """The ledger as a DataFrame, one row per spec (columns: experiment, name, role, spec_id,
    engine, state, step, total_steps, loss, tokens_per_s, run_dir, mlflow_run_id, detail, holder)."""
    import dataclasses

    import pandas as pd

    rows = [dataclasses.asdict(r) for r in records(root, experiment, tracking_uri)]
    cols = [f.name for f in dataclasses.fields(RunRecord)]
    return pd.DataFrame(rows, columns=cols)


def as_experiment(experiment) -> "Experiment | None":
    """An Experiment from an Experiment, an experiment file or a module name; None for a bare name."""
    if experiment is None or isinstance(experiment, Experiment):
        return experiment
    text = str(experiment)
    if text.endswith(".py") or Path(text).is_file():
        return load_experiment(text)
    if "." in text:
        try:
            return load_experiment(text)
        except (ModuleNotFoundError, SpecError):
            return None
    return None


# ---- tracking bookkeeping (what of metrics.jsonl is in which MLflow store) -------------------
def read_tracking(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    p = Path(run_dir) / TRACKING_FILE
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


_tracking_lock = threading.Lock()


def tracking_complete(run_dir: str | Path, uri: str, spec: "Spec") -> bool:
    """Whether the MLflow store at uri is known to hold all of a finished run (by tracking.json)."""
    t = read_tracking(run_dir).get(uri, {})
    return t.get("final_state") == "finished" and int(t.get("synced_step", -1)) >= final_step(spec)


def update_tracking(run_dir: str | Path, uri: str, **fields: Any) -> None:
    with _tracking_lock:
        data = read_tracking(run_dir)
        data.setdefault(uri, {}).update(fields)
        atomic_write_json(Path(run_dir) / TRACKING_FILE, data)


# ---- claims --------------------------------------------------------------------------------
HEARTBEAT_S = 5.0


def stale_after_s() -> float:
    return env.Limits.from_env().claim_stale_s


def _lock_path(run_dir: str | Path, spec_id: str) -> Path:
    return inside(locks_dir(run_dir), f"{spec_id}.lock")


def stop_path(root: str | Path, owner: str) -> Path:
    """The marker by which a submission asks its workers to stop (checked at every step)."""
    return inside(locks_dir(root), f"stop-{owner}")


def request_stop(root: str | Path, owner: str) -> None:
    path = stop_path(root, owner)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def clear_stop(root: str | Path, owner: str) -> None:
    stop_path(root, owner).unlink(missing_ok=True)


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of pid (clock ticks since boot) and whether it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{fields[0]}:{fields[19]}"  # state, starttime


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _proc_start(pid)
    if now is None:
        return start is None  # no /proc here: trust kill(0)
    if now.startswith("Z:") or now.startswith("X:"):
        return False
    return start is None or now.split(":")[1] == start.split(":")[1]


def _read_lock(path: Path) -> tuple[dict, float] | None:
    try:
        mtime = path.stat().st_mtime
        return json.loads(path.read_text()), mtime
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _is_dead(info: dict, mtime: float) -> bool:
    if time.time() - mtime > stale_after_s():
        return True
    if info.get("host") == socket.gethostname():
        return not _pid_alive(int(info.get("pid", -1)), info.get("pid_start"))
    return False


def live_claim(run_dir: str | Path, spec_id: str) -> dict | None:
    """The holder of spec_id's claim on run_dir if it is alive, else None."""
    got = _read_lock(_lock_path(run_dir, spec_id))
    if got is None or _is_dead(*got):
        return None
    return got[0]


def _create_exclusive(path: Path, payload: dict) -> bool:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    tmp.write_text(json.dumps(payload))
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _break(path: Path, token: str) -> None:
    """Remove the lock at path if it still carries token, under a break mutex."""
    mutex = path.with_name(path.name + ".break")
    me = {"host": socket.gethostname(), "pid": os.getpid(), "token": secrets.token_hex(8)}
    if not _create_exclusive(mutex, me):
        got = _read_lock(mutex)
        if got is not None and time.time() - got[1] > 30:  # a breaker that died mid-break
            mutex.unlink(missing_ok=True)
        return
    try:
        got = _read_lock(path)
        if got is not None and got[0].get("token") == token:
            path.unlink(missing_ok=True)
    finally:
        mutex.unlink(missing_ok=True)


class Claim:
    """A held claim on one spec id; a daemon thread refreshes its heartbeat until release()."""

    def __init__(self, path: Path, info: dict, heartbeat_s: float = HEARTBEAT_S):
        self.path, self.info, self.token = path, info, info["token"]
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True, name="ladder-claim")
        self._thread.start()

    @classmethod
    def acquire(
        cls, claim_dir: str | Path, spec_id: str, owner: str, heartbeat_s: float = HEARTBEAT_S, **info: Any
    ) -> "Claim | None":
        """The claim in claim_dir's locks/ (a run dir's), or None when a live holder of another
        owner has it."""
        path = _lock_path(claim_dir, spec_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "spec_id": spec_id,
            "owner": owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _proc_start(os.getpid()),
            "token": secrets.token_hex(8),
            "since": time.time(),
            **info,
        }
        for _ in range(5):
            if _create_exclusive(path, payload):
                return cls(path, payload, heartbeat_s)
            got = _read_lock(path)
            if got is None:
                continue  # released between our attempt and the read
            holder, mtime = got
            if holder.get("owner") == owner or _is_dead(holder, mtime):
                _break(path, holder.get("token", ""))
                time.sleep(0.05)
                continue
            return None
        return None

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            got = _read_lock(self.path)
            if got is None or got[0].get("token") != self.token:
                self.lost = True  # someone judged us dead and took over: stop training
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.lost = True
                return

    def release(self) -> None:
        self._stop.set()
        got = _read_lock(self.path)
        if got is not None and got[0].get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
