"""MLflow stores, experiments and submissions (ladder/tracking.py describes the tracking model): the
store a ladder root logs to, one client per store, the experiment of a ladder (in the UI's training
view, with a note listing its runs), a parent run per submission, and artifacts (forecasts) logged
to a ladder's latest parent."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from core import env
from core.safeload import load_file
from ladder import ledger

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from core.spec import Spec
    from ladder.experiment import Experiment

PARAM_VALUE_LIMIT = 500  # the smallest limit of MLflow servers still in use


def truncate(s: str, limit: int = PARAM_VALUE_LIMIT) -> str:
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ---- stores ------------------------------------------------------------------------------------
def default_tracking_uri(root: str | Path) -> str:
    return f"sqlite:///{Path(root) / 'mlflow.db'}"


def resolve_tracking_uri(uri: str | None, root: str | Path) -> str:
    """--tracking-uri, else $MOE_LADDER_TRACKING_URI, else $MLFLOW_TRACKING_URI, else the root's SQLite."""
    return uri or env.text("TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(root)


def _quiet() -> None:
    for name in ("mlflow", "alembic", "sqlalchemy", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # logs each SQL error with its traceback before raising it as an MlflowException, which the
    # callers here report in one line
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def check_store_writable(uri: str) -> None:
    """OSError naming the file unless an embedded SQLite store can be written (its file, and its
    directory, where SQLite keeps its journal). A server's store is its own business: an outage
    there is caught up later (`ladder sync`), a read-only local file never would be."""
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    if not db.parent.exists():
        return  # prepare_store makes it (an error there names the path)
    try:
        with tempfile.TemporaryFile(dir=db.parent):
            pass
        if db.exists():
            open(db, "r+b").close()
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror}: the MLflow store cannot be written (give a writable --tracking-uri, "
                      "or --no-tracking)", str(db)) from None


def bounded_http_retries() -> None:
    """A worker must not block for minutes on a dead server (MLflow's default retries back off
    for ~4 minutes); the user's own settings win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def store_errors() -> tuple[type[Exception], ...]:
    """What an MLflow store out of reach raises (analysis.runs.sources.STORE_ERRORS: MLflow's own
    error, SQLAlchemy's, OSError), for an except clause: its module, with mlflow, is imported only when
    an error is matched, so that the CLI starts without mlflow."""
    from analysis.runs.sources import STORE_ERRORS

    return STORE_ERRORS


@lru_cache(maxsize=8)
def client(uri: str) -> "MlflowClient":
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # stdout is for `ladder runs --json`
    from mlflow import MlflowClient

    _quiet()  # after the import: mlflow sets its own logger up when imported
    return MlflowClient(tracking_uri=uri)


def prepare_store(uri: str) -> None:
    """Create the embedded SQLite store once, in the controller, before any worker opens it:
    concurrent first-time creation of the schema races."""
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client(uri).search_experiments(max_results=1)


def _artifact_location(uri: str) -> str | None:
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
    return None  # a server decides where artifacts go


# The MLflow UI opens an experiment by this tag (EXPERIMENT_KIND_TAG_KEY in mlflow's
# server/js/src/experiment-tracking/utils/ExperimentKindUtils.ts); untagged, it may open the GenAI
# view (traces, an assistant panel). custom_model_development opens "Model training": the runs.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


TRAINING_VIEW = "workflowType=machine_learning"


def ui_url(base: str, exp_id: str | None = None) -> str:
    """The MLflow UI's page of an experiment, in its training view. MLflow 3 opens an experiment in
    the workflow type kept in the browser (GenAI by default: traces) whatever the experiment-kind
    tag; the page's `workflowType` query parameter (server/js .../ExperimentPageWorkflowTypeContext:
    genai | machine_learning) sets it, so the link says machine_learning."""
    base = base.rstrip("/")
    return f"{base}/#/experiments/{exp_id}?{TRAINING_VIEW}" if exp_id else base


def run_path(exp_id: str, run_id: str, charts: bool = False) -> str:
    """A run's page (its "Model metrics" charts with `charts`) in the training view, relative to the
    UI's root. Without the query parameter MLflow 3.17 shows a run as a GenAI "Evaluation" (its
    side bar traces, sessions and judges; checked in headless Chromium, tests/ladder/test_mlflow_ui.py)."""
    return f"#/experiments/{exp_id}/runs/{run_id}{'/model-metrics' if charts else ''}?{TRAINING_VIEW}"


def run_ui_url(base: str, exp_id: str, run_id: str, charts: bool = False) -> str:
    return f"{base.rstrip('/')}/{run_path(exp_id, run_id, charts)}"


NOTE_TAG = "mlflow.note.content"  # the experiment page shows it as the experiment's description


def write_experiment_note(uri: str, exp_id: str) -> None:
    """The experiment's description: every spec's run, linked, with its role, engine and state, so
    the runs nested (collapsed) under their submissions can be read and opened from the experiment
    page itself."""
    c = client(uri)
    runs, token = [], None
    while True:
        page = c.search_runs([exp_id], "tags.`ladder.kind` = 'run'", max_results=1000, page_token=token,
                             order_by=["attributes.start_time ASC"])
        runs.extend(page)
        token = page.token
        if not token:
            break
    lines = ["Runs of this ladder, one per spec (nested under the submission that last trained them):", "",
             "| spec | role | engine | state | spec id |", "|---|---|---|---|---|"]
    for r in runs:
        t = r.data.tags
        state = t.get("ladder.state") or r.info.status.lower()
        lines.append(f"| [{t.get('rung', r.info.run_name)}]({run_path(exp_id, r.info.run_id, charts=True)}) | "
                     f"{t.get('role', '')} | {t.get('engine', '')} | {state} | {t.get('spec_id', '')} |")
    c.set_experiment_tag(exp_id, NOTE_TAG, "\n".join(lines) + "\n")


def experiment_id(uri: str, name: str) -> str:
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is None:
        try:
            return c.create_experiment(name, artifact_location=_artifact_location(uri),
                                       tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except store_errors():  # RESOURCE_ALREADY_EXISTS, say: created concurrently by another process
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        c.restore_experiment(exp.experiment_id)
    if EXPERIMENT_KIND_TAG not in exp.tags:  # made before the tag was set here
        c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


# ---- submissions (parent runs) ---------------------------------------------------------------
@dataclass
class Submission:
    uri: str
    experiment_id: str
    run_id: str


def close_dead_submissions(uri: str, exp_id: str) -> list[str]:
    """Parent runs left RUNNING by a submission process that died on this host (SIGKILL, a lost
    machine) are marked KILLED, so the MLflow UI does not show them live forever."""
    import socket

    c = client(uri)
    host, closed = socket.gethostname(), []
    query = "tags.`ladder.kind` = 'submission' and attributes.status = 'RUNNING'"
    for r in c.search_runs([exp_id], query, max_results=200):
        t = r.data.tags
        if t.get("host") != host or not t.get("pid", "").isdigit():
            continue
        if not ledger._pid_alive(int(t["pid"]), t.get("pid_start") or None):
            c.set_terminated(r.info.run_id, "KILLED")
            closed.append(r.info.run_id)
    return closed


def start_submission(uri: str, experiment: "Experiment", specs: list["Spec"], tags: dict[str, str]) -> Submission:
    c = client(uri)
    exp_id = experiment_id(uri, experiment.name)
    close_dead_submissions(uri, exp_id)
    run = c.create_run(
        exp_id,
        run_name=f"submit-{time.strftime('%Y%m%d-%H%M%S')}",
        tags={
            "ladder.kind": "submission",
            "experiment_file": experiment.path,
            "n_specs": str(len(specs)),
            "specs": truncate(",".join(s.name for s in specs)),
            **tags,
        },
    )
    return Submission(uri, exp_id, run.info.run_id)


def end_submission(sub: Submission, status: str) -> None:
    client(sub.uri).set_terminated(sub.run_id, status)


def latest_parent_run(uri: str, experiment_name: str, create: bool = True) -> str | None:
    """The ladder's newest submission run (analysis attaches its files there)."""
    c = client(uri)
    exp_id = experiment_id(uri, experiment_name)
    runs = c.search_runs([exp_id], "tags.`ladder.kind` = 'submission'", order_by=["attributes.start_time DESC"], max_results=1)
    if runs:
        return runs[0].info.run_id
    if not create:
        return None
    run = c.create_run(exp_id, run_name="analysis", tags={"ladder.kind": "submission"})
    c.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _experiment_name(experiment: "str | Experiment") -> str:
    return experiment if isinstance(experiment, str) else experiment.name


def log_artifact_to_parent(
    experiment: "str | Experiment",
    path: str | Path,
    artifact_path: str | None = None,
    tracking_uri: str | None = None,
    root: str | Path | None = None,
) -> str:
    """Attach a file (forecast.json, a plot, a report) to the ladder's latest parent run; returns
    the run id."""
    uri = resolve_tracking_uri(tracking_uri, ledger.ladder_root(root))
    prepare_store(uri)
    run_id = latest_parent_run(uri, _experiment_name(experiment))
    client(uri).log_artifact(run_id, str(path), artifact_path)
    return run_id


def log_forecast(
    experiment: "str | Experiment",
    forecast: "dict | str | Path",
    tracking_uri: str | None = None,
    root: str | Path | None = None,
) -> str:
    """forecast.json (a dict or a file) as an artifact of the latest parent run, plus the hero's
    predicted final loss and interval as metrics when the forecast has them."""
    uri = resolve_tracking_uri(tracking_uri, ledger.ladder_root(root))
    prepare_store(uri)
    run_id = latest_parent_run(uri, _experiment_name(experiment))
    c = client(uri)
    if isinstance(forecast, dict):
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / "forecast.json"
            p.write_text(json.dumps(forecast, indent=2, default=float))
            c.log_artifact(run_id, str(p))
        data = forecast
    else:
        c.log_artifact(run_id, str(forecast))
        data = load_file(forecast, "json")
    final = ((data or {}).get("hero") or {}).get("final_loss") or {}
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"forecast.hero_final_loss.{k}", float(final[k]), now, 0) for k in ("mean", "lo", "hi") if k in final]
    if metrics:
        c.log_batch(run_id, metrics=metrics)
    return run_id
