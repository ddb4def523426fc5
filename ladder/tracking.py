"""MLflow tracking: one experiment per ladder, a parent run per submission, a child run per spec.

A spec has exactly one child run per tracking store, found again by its `spec_id` tag: a run that
is interrupted and resumed, even by a later submission, keeps logging into the same run (which
moves under the submission that continues it), so a run's curve is never split or repeated.

Metrics come from the run dir's metrics.jsonl, the source of truth, in batches of whole steps
(`MlflowClient.log_batch`, at most 1,000 values a call) from one background thread of the
controller (TrackingPump), so a slow or absent tracking server never stalls training and a
training process never spends time on MLflow. What is in MLflow is always decided by
asking MLflow: every record carries every key with the `loss` key in all of them, a batch holds
whole steps in order and is committed atomically, so the largest logged step of `loss` is exactly
where the upload stopped. After any failure the uploader asks again before sending, and
`ladder sync` does the same, so an outage loses nothing and duplicates nothing. (Values are sent
with the timestamps of the records, so even a racing re-send is an exact duplicate, which the SQL
store rejects by primary key.)

The stores, the ladder's experiment and the submissions' parent runs are in ladder/mlflow_store.py;
this module keeps a spec's run (RunTracker), the controller's uploader (TrackingPump) and sync.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from core.rundir import parse_metrics_lines
from engines.base import METRICS_FILE
from ladder import ledger
# the stores, experiments and submissions (parent runs), under tracking's names too
from ladder.mlflow_store import (EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, NOTE_TAG, PARAM_VALUE_LIMIT,  # noqa: F401
                                 Submission, bounded_http_retries, check_store_writable, client, close_dead_submissions,
                                 default_tracking_uri, end_submission, experiment_id, latest_parent_run,
                                 log_artifact_to_parent, log_forecast, prepare_store, resolve_tracking_uri,
                                 start_submission, store_errors, ui_url, write_experiment_note)
from ladder.mlflow_store import truncate as _truncate
from core.spec import load_spec

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from core.spec import Spec

SENTINEL_KEY = "loss"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
MAX_PARAMS_PER_BATCH = 100
NOT_METRICS = {"step", "time", "extra"}
NOT_METRIC_EXTRAS = {"eval_periodic_windows"}  # a constant of the run (its periodic eval's sample size)
MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "diverged": "FAILED", "interrupted": "KILLED"}

log = logging.getLogger("ladder.tracking")


# ---- one spec's run ------------------------------------------------------------------------------
def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, (list, tuple)):
        out[prefix[:-1]] = _truncate(json.dumps(d, separators=(",", ":")))
    else:
        out[prefix[:-1]] = _truncate(str(d))
    return out


def final_eval_name(key: str) -> str:
    """A final eval's key under its own name (eval_loss -> eval_loss_final, eval_loss/<source> ->
    eval_loss_final/<source>, eval_loss_se -> eval_loss_final_se); eval_loss_periodic, the
    periodic sample's value at every eval, keeps its name."""
    if key.startswith("eval_loss") and not key.startswith("eval_loss_periodic"):
        return "eval_loss_final" + key[len("eval_loss"):]
    return key


def record_metrics(rec: dict) -> list[tuple[str, float]]:
    """(key, value) pairs of one metrics.jsonl record: every numeric field but step and time,
    plus the engine's extras. A final eval's losses (extra.eval_final: every window) are logged
    under final_eval_name, so eval_loss stays the periodic evals' curve and the final is its own
    metric."""
    final = (rec.get("extra") or {}).get("eval_final") is True
    name = final_eval_name if final else (lambda k: k)
    out = []
    for k, v in rec.items():
        if k in NOT_METRICS or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out.append((name(k), float(v)))
    for k, v in (rec.get("extra") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_METRIC_EXTRAS:
            out.append((name(k) if k not in rec else f"extra.{k}", float(v)))
    return out


class MetricsTail:
    """Complete new lines of an append-only metrics.jsonl; starts over if the file was replaced
    or truncated (an engine resuming rewrites it), which is safe because uploads skip by step."""

    def __init__(self, path: Path):
        self.path, self._ino, self._offset, self._line = path, None, 0, 1

    def read(self) -> list[dict]:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return []
        if st.st_ino != self._ino or st.st_size < self._offset:
            self._ino, self._offset, self._line = st.st_ino, 0, 1
        if st.st_size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # leave a half-written last line for next time
        self._offset += end
        out = parse_metrics_lines(data[:end], self.path, first_line=self._line)
        self._line += data[:end].count(b"\n")
        return out


class RunTracker:
    """Mirrors one run dir into its MLflow child run."""

    def __init__(
        self,
        uri: str,
        experiment_name: str,
        spec: "Spec",
        run_dir: str | Path,
        parent_run_id: str | None = None,
        experiment_file: str = "",
        reopen: bool = False,
    ):
        self.uri, self.experiment_name, self.spec = uri, experiment_name, spec
        self.reopen = reopen  # a worker resuming the run marks it RUNNING again
        self.run_dir = Path(run_dir)
        self.parent_run_id, self.experiment_file = parent_run_id, experiment_file
        self.run_id: str | None = None
        self.synced_step: int | None = None  # None: ask MLflow before the next upload
        self.uploaded = 0
        self.busy_s = 0.0  # wall time spent talking to MLflow (the price of tracking)
        self.open_s = 0.0  # of which opening the run (create, params, spec artifact): once a run
        self.error: str | None = None
        self._tail = MetricsTail(self.run_dir / METRICS_FILE)
        self._pending: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final_state: str | None = None
        self._recorded_step: int | None = None

    # -- the MLflow side ------------------------------------------------------------------------
    def ensure_run(self) -> str:
        if self.run_id is not None:
            return self.run_id
        t0 = time.perf_counter()
        try:
            return self._open()
        finally:
            self.open_s += time.perf_counter() - t0

    def _open(self) -> str:
        c = client(self.uri)
        exp_id = experiment_id(self.uri, self.experiment_name)
        run_id = self._find_run(c, exp_id)
        if run_id is None:
            run_id = self._create_run(c, exp_id)
        else:
            run = c.get_run(run_id)
            if self.reopen and run.info.status != "RUNNING" and self._final_state is None:
                c.update_run(run_id, status="RUNNING")
            if self.parent_run_id and run.data.tags.get("mlflow.parentRunId") != self.parent_run_id:
                c.set_tag(run_id, "mlflow.parentRunId", self.parent_run_id)
        self.run_id = run_id
        ledger.update_tracking(self.run_dir, self.uri, run_id=run_id)
        return run_id

    def _find_run(self, c: "MlflowClient", exp_id: str) -> str | None:
        known = ledger.read_tracking(self.run_dir).get(self.uri, {}).get("run_id")
        if known:
            try:
                run = c.get_run(known)
                if run.info.lifecycle_stage == "active":
                    return known
            except store_errors() as err:  # a store that no longer has it: fall back to the tag
                if "RESOURCE_DOES_NOT_EXIST" not in str(err) and "not found" not in str(err).lower():
                    raise
        runs = c.search_runs(
            [exp_id],
            f"tags.spec_id = '{self.spec.id}' and tags.`ladder.kind` = 'run'",
            order_by=["attributes.start_time ASC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def _create_run(self, c: "MlflowClient", exp_id: str) -> str:
        from mlflow.entities import Param

        spec = self.spec
        tags = {
            "ladder.kind": "run",
            "spec_id": spec.id,
            "rung": spec.name,
            "role": spec.role,
            "engine": spec.engine,
            "experiment": self.experiment_name,
            "experiment_file": self.experiment_file,
            "run_dir": str(self.run_dir),
        }
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = c.create_run(exp_id, run_name=f"{spec.name}-{spec.id[:8]}", tags=tags)
        params = [Param(k, v) for k, v in flatten(spec.model_dump(mode="json")).items()]
        params.append(Param("spec_id", spec.id))
        params.append(Param("total_steps", str(spec.total_steps)))
        for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
            c.log_batch(run.info.run_id, params=params[i : i + MAX_PARAMS_PER_BATCH])
        spec_file = self.run_dir / ledger.SPEC_FILE
        if spec_file.exists():
            c.log_artifact(run.info.run_id, str(spec_file))
        write_experiment_note(self.uri, exp_id)
        return run.info.run_id

    def logged_step(self) -> int:
        """The largest step MLflow holds for this run (-1: none)."""
        hist = client(self.uri).get_metric_history(self.ensure_run(), SENTINEL_KEY)
        return max((m.step for m in hist), default=-1)

    def upload(self) -> int:
        """Send every record of metrics.jsonl past what MLflow holds; returns values sent."""
        from mlflow.entities import Metric

        for rec in self._tail.read():
            if "step" in rec:
                self._pending[int(rec["step"])] = rec  # a rewritten step replaces the older line
        run_id = self.ensure_run()
        if self.synced_step is None:
            self.synced_step = self.logged_step()
        steps = sorted(s for s in self._pending if s > self.synced_step)
        for s in [s for s in self._pending if s <= self.synced_step]:
            del self._pending[s]
        sent = 0
        batch: list[Metric] = []
        batch_last = None

        def send() -> None:
            nonlocal batch, sent
            try:
                client(self.uri).log_batch(run_id, metrics=batch)
            except Exception:  # any failure of the batch, re-raised: first note what did land
                self._record_synced()  # what earlier batches of this call did land
                self.synced_step = None  # this one may or may not have: ask before resending
                raise
            self.synced_step = batch_last
            sent += len(batch)
            batch = []

        for s in steps:
            rec = self._pending[s]
            ts = int(float(rec.get("time") or time.time()) * 1000)
            values = [Metric(k, v, ts, s) for k, v in record_metrics(rec)]
            if batch and len(batch) + len(values) > MAX_METRICS_PER_BATCH:
                send()
            batch.extend(values)
            batch_last = s
        if batch:
            send()
        for s in steps:
            self._pending.pop(s, None)
        self.uploaded += sent
        self._record_synced()
        return sent

    def _record_synced(self) -> None:
        """tracking.json's synced_step: what MLflow is known to hold (a hint for cheap checks;
        uploads themselves always ask MLflow)."""
        if self.synced_step is not None and self.synced_step != self._recorded_step:
            ledger.update_tracking(self.run_dir, self.uri, synced_step=self.synced_step)
            self._recorded_step = self.synced_step

    def set_final(self, state: str) -> None:
        """Close the MLflow run with the run dir's final state."""
        c = client(self.uri)
        run_id = self.ensure_run()
        c.set_tag(run_id, "ladder.state", state)
        c.set_terminated(run_id, MLFLOW_STATUS.get(state, "FAILED"))
        ledger.update_tracking(self.run_dir, self.uri, final_state=state)
        write_experiment_note(self.uri, c.get_run(run_id).info.experiment_id)

    # -- the background uploader ------------------------------------------------------------------
    def start(self, every_s: float = 2.0) -> "RunTracker":
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True, name="ladder-tracking")
        self._thread.start()
        return self

    def _attempt(self, final: bool) -> bool:
        t0 = time.perf_counter()
        try:
            self.upload()
            if final and self._final_state is not None:
                self.set_final(self._final_state)
            if self.error:
                print(f"[ladder] tracking for {self.spec.name} recovered", file=sys.stderr)
            self.error = None
            return True
        except Exception as err:  # the uploader thread must not die: MLflow down, a locked SQLite, a network error
            # (store_errors) are expected; anything else is a bug, reported with its traceback, and training goes on
            if not isinstance(err, store_errors()):
                traceback.print_exc()
            if self.error is None:
                print(
                    f"[ladder] tracking for {self.spec.name} unavailable ({type(err).__name__}: {str(err)[:200]}); "
                    "metrics.jsonl keeps everything, uploads resume when it is back (or run `ladder sync`)",
                    file=sys.stderr,
                )
            self.error = f"{type(err).__name__}: {str(err)[:200]}"
            self.synced_step = None
            return False
        finally:
            self.busy_s += time.perf_counter() - t0

    def _loop(self, every_s: float) -> None:
        wait = 0.0  # open the MLflow run at once, so it shows while the engine starts
        while not self._stop.wait(wait):
            ok = self._attempt(final=False)
            wait = every_s if ok else min(wait * 2, 30.0)
        self._attempt(final=True)

    def stop(self, final_state: str | None, timeout_s: float = 30.0) -> bool:
        """Upload the rest and close the run; True when MLflow has everything."""
        self._final_state = final_state
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.error = self.error or "tracking did not finish in time"
                return False
        else:
            self._attempt(final=True)
        return self.error is None


# ---- the controller's uploader ------------------------------------------------------------------
class TrackingPump:
    """One thread in the controller mirrors every run of a submission into MLflow.

    The uploads live in the driver, not in the workers: training processes never pay for
    MLflow (its SQL store spends about a millisecond of Python per value, which would land on a
    small model's step), the embedded SQLite store has a single writer (no "database is locked",
    no SQLite over NFS from other nodes), and workers need not import MLflow at all.
    """

    def __init__(self, every_s: float = 2.0):
        self.every_s = every_s
        self.trackers: dict[str, RunTracker] = {}
        self._final: dict[str, str] = {}
        self._done: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ladder-tracking-pump")
        self._thread.start()

    def watch(self, key: str, tracker: RunTracker) -> None:
        with self._lock:
            self.trackers.setdefault(key, tracker)
        self._wake.set()

    def watching(self, key: str) -> bool:
        return key in self.trackers

    def finish(self, key: str, state: str) -> None:
        """The run ended in `state`: upload the rest and close its MLflow run."""
        with self._lock:
            self._final[key] = state
        self._wake.set()

    def _loop(self) -> None:
        backoff = self.every_s
        while True:
            self._wake.wait(backoff)
            self._wake.clear()
            stopping = self._stop.is_set()
            with self._lock:
                work = [(k, t, self._final.get(k)) for k, t in self.trackers.items() if not self._done.get(k)]
            ok_all = True
            for key, tracker, final in work:
                tracker._final_state = final
                ok = tracker._attempt(final=final is not None)
                ok_all &= ok
                if ok and final is not None:
                    self._done[key] = True
            if stopping:
                return
            backoff = self.every_s if ok_all else min(backoff * 2, 30.0)

    def close(self, timeout_s: float = 60.0) -> dict[str, bool]:
        """Flush everything (one last round); {key: True if MLflow has all of that run}."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        return {k: bool(self._done.get(k)) for k in self.trackers}

    @property
    def busy_s(self) -> float:
        return sum(t.busy_s for t in self.trackers.values())

    @property
    def open_s(self) -> float:
        return sum(t.open_s for t in self.trackers.values())


# ---- sync ----------------------------------------------------------------------------------------
@dataclass
class SyncResult:
    experiment: str
    name: str
    run_dir: str
    run_id: str | None
    uploaded: int
    state: str
    error: str | None = None


def sync_runs(root: str | Path | None = None, experiment: str | None = None, tracking_uri: str | None = None) -> list[SyncResult]:
    """Upload to MLflow whatever of each run dir it lacks; runs a live worker is training are
    left to that worker."""
    root = ledger.ladder_root(root)
    uri = resolve_tracking_uri(tracking_uri, root)
    prepare_store(uri)
    results = []
    parents: dict[str, str | None] = {}
    for exp, d in ledger.iter_run_dirs(root, experiment):
        spec = load_spec(d / ledger.SPEC_FILE)
        rec = ledger.run_record(root, exp, spec, d, uri)
        if rec.state == "running":
            results.append(SyncResult(exp, spec.name, str(d), rec.mlflow_run_id, 0, rec.state, "skipped: a worker is training it"))
            continue
        if rec.state == "pending" and rec.step is None:
            continue
        if exp not in parents:
            parents[exp] = latest_parent_run(uri, exp)
        tracker = RunTracker(uri, exp, spec, d, parent_run_id=None)
        if ledger.read_tracking(d).get(uri, {}).get("run_id") is None:
            tracker.parent_run_id = parents[exp]  # a run first seen by sync hangs under the latest submission
        state = {"failed": "interrupted" if rec.detail.startswith("interrupted") else "failed"}.get(rec.state, rec.state)
        try:
            tracker.upload()
            tracker.set_final(state)
            results.append(SyncResult(exp, spec.name, str(d), tracker.run_id, tracker.uploaded, rec.state))
        except store_errors() as err:  # this run's upload failed: noted in its row, the others go on
            results.append(SyncResult(exp, spec.name, str(d), tracker.run_id, tracker.uploaded, rec.state, f"{type(err).__name__}: {err}"))
    return results


def child_runs(uri: str, experiment_name: str) -> list[Any]:
    """Every child run of a ladder (for the ledger's MLflow join and for tests)."""
    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    out, token = [], None
    while True:
        page = c.search_runs([exp.experiment_id], "tags.`ladder.kind` = 'run'", max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def iter_metric_points(uri: str, run_id: str, keys: Iterable[str]) -> dict[str, list[int]]:
    """Steps logged per key (with repeats, so duplicates show)."""
    c = client(uri)
    return {k: [m.step for m in c.get_metric_history(run_id, k)] for k in keys}
