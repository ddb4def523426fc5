"""The worker: how one spec is trained into its run dir, by a submission's Ray task, by a
`ladder submit --local` worker process, and by `ladder train` in the foreground.

    run_claimed  claim the run dir, skip a finished run, train (resuming), stop on a lost claim or
                 a stop request, write the status for every ending, release
    train_task   the submission's task: run_claimed and its outcome record (the worker's boundary)

A claim lives in the run dir (ladder.ledger), so a submission's worker and a `ladder train` of the
same spec and run dir exclude each other.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from core.spec import Spec
from engines.base import DivergedError, read_status, write_status
from engines.checkpoint import resume_step
from engines.options import EngineOptions, Options
from engines.registry import get_engine
from ladder import ledger
from ladder.progress import Reporter
from ladder.train_launch import is_multi_worker, train_on_workers

__all__ = ["Attempt", "Busy", "ClaimLost", "StopRequested", "run_claimed", "train_task"]


class ClaimLost(RuntimeError):
    pass


class StopRequested(Exception):
    """The submission asked its workers to stop (ledger.request_stop): Ctrl-C on the driver."""


class Busy(Exception):
    """Another live process holds the run dir's claim."""

    def __init__(self, holder: dict | None):
        super().__init__(f"held by {holder}")
        self.holder = holder


@dataclass
class Attempt:
    """What one attempt at a spec got to (filled in as it trains, so a failure keeps it)."""

    outcome: str = "failed"  # finished | failed | skipped
    note: str = ""
    who: dict = field(default_factory=dict)  # spec_id, name, host, pid, node of the process training it
    last: Any = None  # the last StepMetrics
    first_step: int = 0
    engine_s: float = 0.0


def run_claimed(spec: Spec, rd: Path, ctx: dict, report: Callable[..., None], att: Attempt) -> Attempt:
    """The one way a spec is trained into a run dir, by a submission's worker and by `ladder
    train`: claim the run dir (Busy if another live process holds it), skip a finished run, train
    from the newest intact checkpoint (from scratch with ctx["resume"] False), check the claim and
    the submission's stop marker at every step, release. The run's status is written for every way
    it ends; a failure is re-raised (ClaimLost, StopRequested, KeyboardInterrupt, DivergedError,
    or the engine's own exception) for the caller to report.

    ctx: owner (the claim's), root (where the stop marker lives), options (the environment's
    engine options, as a dict), resume (default True), ray_train (default True: a multi-worker
    spec trains as a Ray Train job; False: the engine launches its own ranks)."""
    att.who = base = {"spec_id": spec.id, "name": spec.name, "host": socket.gethostname(), "pid": os.getpid(),
                      "node": _node_id()}
    claim = ledger.Claim.acquire(rd, spec.id, ctx["owner"], node=base["node"], run_dir=str(rd))
    if claim is None:
        raise Busy(ledger.live_claim(rd, spec.id))
    resume = ctx.get("resume", True)
    stop = ledger.stop_path(ctx["root"], ctx["owner"])
    try:
        if resume and ledger.is_finished(rd, spec):
            att.outcome, att.note = "skipped", "finished by another submission"
            return att
        if stop.exists():
            raise StopRequested()
        start = resume_step(rd) if resume else 0  # where the run starts: its newest intact checkpoint
        _append_attempt(rd, {**base, "owner": ctx["owner"], "time": time.time(), "step": start})
        report({**base, "step": start}, force=True)
        t0 = time.perf_counter()
        # the spec's options section with the environment's (read where the submission started) on top
        options = EngineOptions.for_spec(spec, Options.model_validate(ctx.get("options", {})))
        steps = (train_on_workers(spec, rd, options=options) if ctx.get("ray_train", True) and is_multi_worker(spec)
                 else get_engine(spec.engine, options).train(spec, rd, resume=resume))
        for m in steps:
            if att.last is None:
                att.first_step = m.step
            att.last = m
            if claim.lost:
                raise ClaimLost("another process took this run dir over (it judged this one dead)")
            if stop.exists():
                raise StopRequested()
            report({**base, "step": m.step + 1, "loss": m.loss, "tokens_per_s": m.tokens_per_s})
        att.engine_s = time.perf_counter() - t0
        att.outcome = "finished" if ledger.is_finished(rd, spec) else "failed"
        if att.outcome == "failed":
            att.note = f"engine stopped at step {att.last.step if att.last else None} of {spec.total_steps}"
        return att
    except DivergedError as err:
        if read_status(rd).get("state") != "diverged":
            write_status(rd, "diverged", reason=str(err), step=att.last.step if att.last else None)
        raise
    except ClaimLost:
        raise  # the run dir is the new holder's now: leave it alone
    except (KeyboardInterrupt, StopRequested):
        write_status(rd, "failed", reason="interrupted", step=att.last.step if att.last else None)
        raise
    except Exception as err:  # recorded in the run's status (a bug too, traceback kept), then re-raised
        if read_status(rd).get("state") in ("running", "pending"):
            write_status(rd, "failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        claim.release()


def train_task(spec_json: str, run_dir: str, ctx: dict) -> dict:
    """Runs on a Ray worker (or a --local worker process): run_claimed, and its outcome record.
    (The controller mirrors the run dir into MLflow; the worker only trains.)"""
    spec = Spec.model_validate_json(spec_json)
    report = Reporter(ctx.get("sink"), spec.id)
    att = Attempt(who={"spec_id": spec.id, "name": spec.name})  # run_claimed adds where it runs
    try:
        run_claimed(spec, Path(run_dir), ctx, report, att)
        state, note = att.outcome, att.note
    except Busy as busy:
        return {**att.who, "outcome": "busy", "holder": busy.holder}
    except DivergedError as err:
        state, note = "diverged", str(err)
    except ClaimLost as err:
        state, note = "interrupted", str(err)
    except (KeyboardInterrupt, StopRequested):
        state, note = "interrupted", "cancelled"
    except Exception as err:  # the worker's boundary: any failure (a bug too, its traceback in status.json) fails this run alone
        state, note = "failed", f"{type(err).__name__}: {err}"
    if state == "skipped":
        return {**att.who, "outcome": "skipped", "note": note}
    last = att.last
    report({**att.who, "step": (last.step + 1) if last else 0, "loss": last.loss if last else None, "state": state}, force=True)
    return {
        **att.who,
        "outcome": state,
        "note": note,
        "step": None if last is None else last.step,
        "loss": None if last is None else last.loss,
        "engine_s": att.engine_s,
        "steps_run": 0 if last is None else last.step + 1 - att.first_step,
    }


def _node_id() -> str | None:
    try:
        import ray

        if not ray.is_initialized():  # (the runtime context would start a local Ray)
            return None
        return ray.get_runtime_context().get_node_id()
    except (ImportError, RuntimeError):  # RuntimeError: Ray shut down since the check
        return None


def _append_attempt(run_dir: Path, rec: dict) -> None:
    """attempts.jsonl: who started (or resumed) this run, when, where, from which step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "attempts.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
