"""Where a run's metrics come from: a file (run dir, metrics.jsonl, CSV), any MLflow run, or a W&B run
(analysis/runs/wandb_runs.py).

    src = open_source("mlflow:RUN_ID", tracking_uri="http://127.0.0.1:5000", names=load_metric_names("olmo-core"))
    df = src.read()          # the whole history, paged
    df = src.read()          # again: only the points logged since are fetched
    src.status()             # {"state": "running" | "finished" | "failed" | "interrupted"}

An MLflow run is read through the MLflow client, key by key, in pages of `page_size` points
(`get_metric_history` with `max_results` and a page token: the tracking server's own paging,
ordered by timestamp then step). A source remembers how many points of each key it has read, so a
later read asks only for what was logged since. Steps logged again (a resumed writer) keep their
last value. Without a metric-name map only the keys this project knows (its own names and the usual
aliases) are fetched; with one, the keys the map names.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import requests

os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # stdout is for --json
from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.utils.search_utils import SearchUtils  # noqa: E402
from sqlalchemy.exc import SQLAlchemyError  # noqa: E402 (mlflow's SQL store)

from analysis.runs.names import ALIASES, MetricNames, matches  # noqa: E402
from analysis.runs.metrics import MetricsError, RunRef, finish_frame, read_metrics_frame, resolve_run  # noqa: E402
from analysis.runs.wandb_runs import WANDB_PREFIX, WandbApiSource, WandbDirSource, open_wandb  # noqa: E402
from core.spec import load_spec  # noqa: E402

__all__ = ["MLFLOW_PREFIX", "FileSource", "MlflowSource", "open_source"]

MLFLOW_PREFIX = "mlflow:"
PAGE_SIZE = 5000
# what an MLflow store out of reach raises: MLflow's own error (its client wraps a refused connection,
# a locked SQLite), SQLAlchemy's for a damaged SQLite file, OSError (requests' network errors)
STORE_ERRORS = (MlflowException, SQLAlchemyError, OSError)
NO_SUCH_RUN = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # MLflow's codes for a run id it does not hold
MLFLOW_STATE = {"RUNNING": "running", "SCHEDULED": "running", "FINISHED": "finished", "FAILED": "failed",
                "KILLED": "interrupted"}


@dataclass
class FileSource:
    """A run directory, metrics.jsonl or CSV; every read reads the file again (it is local)."""

    ref: RunRef
    columns: dict[str, str] | None = None
    names: MetricNames | None = None

    @property
    def label(self) -> str:
        return self.ref.label

    @property
    def spec(self) -> Any:
        return self.ref.spec

    def read(self) -> pd.DataFrame:
        return read_metrics_frame(self.ref.metrics_path, self.columns, self.names)

    def status(self) -> dict:
        return self.ref.status()

    def describe(self) -> dict:
        return {"kind": "file", "metrics": str(self.ref.metrics_path)}


@dataclass
class MlflowSource:
    """One MLflow run, read incrementally through the MLflow client."""

    uri: str
    run_id: str
    names: MetricNames | None = None
    columns: dict[str, str] | None = None
    page_size: int = PAGE_SIZE
    points_fetched: int = 0
    requests: int = 0
    _offset: dict[str, int] = field(default_factory=dict)
    _values: dict[str, dict[int, float]] = field(default_factory=dict)
    _times: dict[int, float] = field(default_factory=dict)
    _spec: Any = None
    _spec_read: bool = False

    def __post_init__(self) -> None:
        for name in ("mlflow", "alembic", "urllib3"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if self.uri.startswith("sqlite:///") and not Path(self.uri[len("sqlite:///"):]).exists():
            # MLflow would create an empty store there and then find no run in it
            raise MetricsError(f"{self.label}: no MLflow store at {self.uri} (the file does not exist)")
        self.client = MlflowClient(tracking_uri=self.uri)
        try:
            self._run = self.client.get_run(self.run_id)
        except MlflowException as e:
            # the client wraps a connection error (refused, timed out) in an MlflowException
            if isinstance(e.__cause__ or e.__context__, (requests.ConnectionError, requests.Timeout)):
                raise MetricsError(f"{self.label}: cannot reach the tracking server {self.uri} ({_first_line(e)})") from None
            if e.error_code in NO_SUCH_RUN:  # the store answered: it has no such run
                raise MetricsError(f"{self.label}: no such run at {self.uri} ({_first_line(e)})") from None
            raise MetricsError(f"{self.label}: {self.uri} did not answer as an MLflow tracking server "
                               f"({_first_line(e)})") from None
        except (SQLAlchemyError, OSError) as e:  # a store that cannot be opened (a damaged SQLite file, a network error)
            raise MetricsError(f"{self.label}: cannot reach the tracking server {self.uri} ({_first_line(e)})") from None

    @property
    def label(self) -> str:
        return f"{MLFLOW_PREFIX}{self.run_id}"

    # ---- what the run holds -----------------------------------------------------------------
    def _keys(self) -> list[str]:
        keys = sorted(self._run.data.metrics)
        if self.names is not None:
            return self.names.wanted(keys)
        known = {a.lower() for names in ALIASES.values() for a in names} | set(ALIASES)
        known |= {k.lower() for k in (self.columns or {}).values()}
        return [k for k in keys if k.lower() in known]

    def _is_loss_key(self, key: str) -> bool:
        if self.names is not None and "loss" in self.names.entries:
            return any(matches(key, p) for p in self.names.entries["loss"].names)
        if self.columns and "loss" in self.columns:
            return key == self.columns["loss"]
        return key.lower() in ALIASES["loss"]

    def _fetch(self, key: str) -> None:
        """The points of `key` past those already read, page by page."""
        # The tracking store's own paged call (GetMetricHistory with max_results and a page token,
        # an offset into the history in (timestamp, step) order); MlflowClient.get_metric_history
        # has no page arguments and fetches every page at once.
        store = getattr(getattr(self.client, "_tracking_client", None), "store", None)
        offset = self._offset.get(key, 0)
        values = self._values.setdefault(key, {})
        while True:
            if store is not None:
                token = SearchUtils.create_page_token(offset).decode() if offset else None
                page = store.get_metric_history(self.run_id, key, max_results=self.page_size, page_token=token)
                more = bool(page.token) and len(page) > 0
            else:  # a client without a reachable store: the whole history, keeping what is new
                page, more = self.client.get_metric_history(self.run_id, key)[offset:], False
            self.requests += 1
            for m in page:
                values[int(m.step)] = _value(m.value)
                t = m.timestamp / 1000.0
                if t > self._times.get(int(m.step), 0.0):
                    self._times[int(m.step)] = t
            offset += len(page)
            self._offset[key] = offset  # page by page: a read cut short resumes after the last page
            self.points_fetched += len(page)
            if not more:
                break

    def read(self) -> pd.DataFrame:
        try:
            self._run = self.client.get_run(self.run_id)
            keys = self._keys()
            for k in keys:
                self._fetch(k)
        except MetricsError:
            raise
        except STORE_ERRORS as e:  # the server went away mid-watch: what was read is kept, the next read resumes
            raise MetricsError(f"{self.label}: reading {self.uri} failed ({_first_line(e)})") from None
        return self._frame(keys)

    def _frame(self, keys: list[str]) -> pd.DataFrame:
        if not keys:
            have = ", ".join(sorted(self._run.data.metrics)[:20]) or "none"
            raise MetricsError(
                f"{self.label}: no metric this project reads (metrics logged: {have}); "
                "name the stack with --metric-names (olmo-core, levanter, torchtitan or a YAML map)"
            )
        # the steps that logged a loss (a NaN loss too): eval or throughput logged at other steps
        # must not read as a missing, non-finite loss
        loss_keys = [k for k in self._values if self._is_loss_key(k)]
        steps = sorted(set().union(*(self._values[k].keys() for k in (loss_keys or self._values))))
        if not steps:
            raise MetricsError(f"{self.label}: no metric records")
        wide = pd.DataFrame({"step": np.asarray(steps, dtype=np.int64)})
        for k, v in self._values.items():
            wide[k] = [v.get(s, np.nan) for s in steps]
        wide["time"] = [self._times.get(s, np.nan) for s in steps]
        return finish_frame(wide, self.label, self.columns, self.names)

    def status(self) -> dict:
        info = self._run.info
        return {"state": MLFLOW_STATE.get(info.status, info.status.lower()), "mlflow_status": info.status}

    @property
    def spec(self) -> Any:
        """The spec YAML this project logs as a run artifact, if the run has one."""
        if not self._spec_read:
            self._spec_read = True
            self._spec = self._artifact_spec()
        return self._spec

    def _artifact_spec(self) -> Any:
        try:
            names = [a.path for a in self.client.list_artifacts(self.run_id)]
        except STORE_ERRORS:  # artifacts out of reach: the run is read without its spec
            return None
        hit = next((n for n in names if fnmatch.fnmatch(n, "spec.y*ml")), None)
        if hit is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            local = self.client.download_artifacts(self.run_id, hit, tmp)
            return load_spec(Path(local))

    # what the replanner asks a run reference (it has no run directory, so no checkpoints here)
    run_dir: Path | None = None

    def checkpoint_steps(self) -> list[int]:
        return []

    def describe(self) -> dict:
        return {"kind": "mlflow", "tracking_uri": self.uri, "run_id": self.run_id,
                "points_fetched": self.points_fetched, "requests": self.requests,
                "metric_names": self.names.label if self.names else None}


def _value(v: float) -> float:
    """A logged value as it was logged: MLflow's SQL store keeps an infinite value as the largest
    finite double (its sign kept), which would read as a huge but finite loss."""
    v = float(v)
    return math.copysign(math.inf, v) if abs(v) >= sys.float_info.max else v


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def open_source(run: str | None, metrics: str | None = None, *, root: str | None = None,
                tracking_uri: str | None = None, names: MetricNames | None = None,
                columns: dict[str, str] | None = None) -> FileSource | MlflowSource | WandbDirSource | WandbApiSource:
    """RUN (`mlflow:RUN_ID`, `wandb:DIR`, `wandb:ENTITY/PROJECT/RUN_ID`, a spec id in the ledger, a run
    dir or a metrics file) or --metrics FILE."""
    if run is not None and run.startswith(WANDB_PREFIX):
        if metrics is not None:
            raise MetricsError("give either a RUN (here wandb:...) or --metrics FILE, not both")
        return open_wandb(run, names, columns)
    if run is not None and run.startswith(MLFLOW_PREFIX):
        if metrics is not None:
            raise MetricsError("give either a RUN (here mlflow:RUN_ID) or --metrics FILE, not both")
        run_id = run[len(MLFLOW_PREFIX):].strip()
        if not run_id:
            raise MetricsError(f"{run!r}: name the run, mlflow:RUN_ID")
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise MetricsError(f"{run}: which tracking server? give --tracking-uri (or set MLFLOW_TRACKING_URI)")
        # a watcher asks again at its next interval: no minutes of retries on a server that is down
        # (the user's own settings win)
        for var, value in (("MAX_RETRIES", "2"), ("BACKOFF_FACTOR", "1"), ("TIMEOUT", "20")):
            os.environ.setdefault(f"MLFLOW_HTTP_REQUEST_{var}", value)
        return MlflowSource(uri, run_id, names, columns)
    return FileSource(resolve_run(run, metrics, root), columns, names)
