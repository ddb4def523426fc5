"""A submission's MLflow side: its parent run and the pump that mirrors each run dir into its child
run while a worker trains it (Mirror), and the finished runs MLflow does not hold in full, uploaded
when a submission starts (untracked, catch_up). MLflow away never stops training: metrics.jsonl
keeps everything and `ladder sync` uploads it later."""

from __future__ import annotations

import os
import shlex
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from core.spec import Spec
from ladder import ledger, tracking
from ladder.experiment import Experiment
from ladder.planning import Planned
from ladder.tracking import resolve_tracking_uri

if TYPE_CHECKING:
    from ladder.controller import SubmitResult


def untracked(root: Path, tracking_uri: str | None, planned: list[Planned]) -> list[Planned]:
    """Finished runs the tracking store is not known to hold in full (cheap: tracking.json)."""
    uri = resolve_tracking_uri(tracking_uri, root)
    return [p for p in planned if p.action == "skip-finished" and not ledger.tracking_complete(p.run_dir, uri, p.spec)]


def catch_up(console: Console, root: Path, tracking_uri: str | None, exp: Experiment, backlog: list[Planned]) -> None:
    uri = tracking.resolve_tracking_uri(tracking_uri, root)
    tracking.bounded_http_retries()
    try:
        tracking.prepare_store(uri)
        # a submission killed on this host leaves its parent RUNNING; with nothing to train no
        # parent of this one's start_submission would close it
        tracking.close_dead_submissions(uri, tracking.experiment_id(uri, exp.name))
        parent = tracking.latest_parent_run(uri, exp.name)
        sent = 0
        for p in backlog:
            t = tracking.RunTracker(uri, exp.name, p.spec, p.run_dir, parent, exp.path)
            sent += t.upload()
            t.set_final("finished")
        console.print(f"uploaded {sent} missing metric values of {len(backlog)} finished run(s) to MLflow", highlight=False)
    except tracking.store_errors() as err:
        console.print(
            f"warning: {len(backlog)} finished run(s) are not fully in MLflow at {uri} ({type(err).__name__}); "
            f"`ladder sync {exp.name}` uploads them when it is reachable",
            highlight=False,
        )


class Mirror:
    """The submission's MLflow side: its parent run, and a pump that mirrors each run dir into
    the run's child run from the moment a worker starts training it."""

    def __init__(self, console: Console, root: Path, uri: str | None, exp: Experiment, specs: list[Spec], owner: str):
        self.uri = tracking.resolve_tracking_uri(uri, root)
        self.exp = exp
        self.sub = None
        tracking.bounded_http_retries()  # the controller must not hang for minutes on a dead server
        try:
            tracking.prepare_store(self.uri)
            self.sub = tracking.start_submission(
                self.uri, exp, specs, {"owner": owner, "host": socket.gethostname(), "pid": str(os.getpid()),
                 "pid_start": ledger._proc_start(os.getpid()) or "", "argv": shlex.join(sys.argv)[:490]}
            )
        except tracking.store_errors() as err:
            console.print(
                f"warning: MLflow at {self.uri} is unreachable ({type(err).__name__}); training goes on, metrics.jsonl "
                "keeps everything, and `ladder sync` uploads it later",
                highlight=False,
            )
        self.parent_run_id = None if self.sub is None else self.sub.run_id
        self.pump = tracking.TrackingPump()

    def started(self, p: Planned) -> None:
        if not self.pump.watching(p.spec.id):
            self.pump.watch(
                p.spec.id,
                tracking.RunTracker(self.uri, self.exp.name, p.spec, p.run_dir, self.parent_run_id, self.exp.path, reopen=True),
            )

    def ended(self, p: Planned, state: str) -> None:
        self.started(p)
        self.pump.finish(p.spec.id, state)

    def adopt(self, p: Planned) -> None:
        """A run another submission finished: upload what MLflow lacks if that submission's
        controller died before it could (a second uploader is harmless: re-sent points are exact
        duplicates, which the store drops)."""
        if not ledger.tracking_complete(p.run_dir, self.uri, p.spec):
            self.ended(p, "finished")

    def close(self, result: SubmitResult, status: str, timeout_s: float = 60.0) -> None:
        synced = self.pump.close(timeout_s)
        result.tracking_s, result.tracking_open_s = self.pump.busy_s, self.pump.open_s
        for sid, out in result.outcomes.items():
            if sid in synced:
                out["tracking_synced"] = synced[sid]
                out["tracking_error"] = self.pump.trackers[sid].error
        if self.sub is not None:
            try:
                tracking.end_submission(self.sub, status)
            except tracking.store_errors():
                pass  # the parent run's status is cosmetic; the runs themselves are in the run dirs
