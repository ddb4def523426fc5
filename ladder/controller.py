"""Scheduling: turn an experiment's specs into Ray tasks, one per spec, and see them through.

    plan      which specs to run (selection, engine override, ledger: finished ones are skipped)
    feasible  refuse at once a resource request no node of the cluster can ever satisfy
    dispatch  submit, stream progress, defer specs another submission holds, collect outcomes
    the worker  ladder.worker.train_task: claim the run dir, train the spec (resuming)

The plan and the feasibility check live in ladder.planning, the submission's MLflow side in
ladder.mirror; what is done lives in ladder.ledger, the display in ladder.progress, MLflow in
ladder.tracking.
A worker or node lost mid-run is retried by Ray (max_retries) and resumes from its checkpoint;
a submission killed outright is finished by running it again.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from ladder import ledger, localray
from ladder.errors import LadderError, describe
from ladder.experiment import Experiment, load_experiment
from ladder.preflight import check_memory
from core.rundir import RunDir
from engines.options import Options
from ladder.local import dispatch_local, infeasible, local_gpus
from ladder.progress import SweepDisplay, progress_sink
from ladder.worker import train_task
from ladder.tracking import check_store_writable, resolve_tracking_uri
from ladder.mirror import Mirror, catch_up, untracked
from ladder.planning import (Planned, check_feasible, plan, plan_table, resources_of,  # noqa: F401 (the controller's names)
                            select_specs)

DEFER_POLL_S = 2.0
STOP_GRACE_S = 10.0  # how long a Ctrl-C waits for workers to stop at a step before ray.cancel


# ---- dispatch ----------------------------------------------------------------------------------------
@dataclass
class SubmitResult:
    experiment: str
    planned: list[Planned]
    outcomes: dict[str, dict] = field(default_factory=dict)  # spec id -> the worker's answer
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    wall_s: float = 0.0
    interrupted: bool = False
    tracking_s: float = 0.0  # the controller's time in MLflow calls (a background thread)
    tracking_open_s: float = 0.0  # of which opening child runs (create, params, spec.yaml)

    @property
    def ok(self) -> bool:
        """Every selected spec finished: none failed, none was interrupted, none was left diverged."""
        return (not self.interrupted and all(o.get("outcome") in ("finished", "skipped") for o in self.outcomes.values())
                and not any(p.action == "skip-diverged" for p in self.planned))


def _local_resources() -> dict[str, float]:
    """What a local Ray started here would offer: every CPU, and the CUDA devices here (local_gpus)."""
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(local_gpus())}


def _start_ray(address: str | None, timeout_s: float | None = None) -> "Callable[[], None] | None":
    """Connect or start; the shutdown to call when this call started or joined Ray, else None."""
    import ray

    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=True)
    try:
        if address:
            localray.join(address, localray.ray_timeout_s(timeout_s), **kwargs)
            return ray.shutdown
        # "local": a fresh instance on 127.0.0.1, never a stale cluster this machine happens to have
        return localray.LocalRay(os.cpu_count() or 1, **kwargs).shutdown
    except (ConnectionError, ValueError, RuntimeError) as err:
        raise LadderError(f"cannot start or join Ray{f' at {address}' if address else ''}: {err}") from err


def resume_hint(exp: Experiment, only, engine, address, include_hero, tracking_uri, root) -> str:
    args = ["ladder", "submit", exp.path or exp.name]
    for flag, val in (("--only", only), ("--engine", engine), ("--address", address), ("--tracking-uri", tracking_uri), ("--root", root)):
        if val:
            args += [flag, str(val)]
    if include_hero:
        args.append("--include-hero")
    return shlex.join(args)


def submit(
    experiment: "str | Path | Experiment",
    *,
    only: str | None = None,
    engine: str | None = None,
    address: str | None = None,
    max_concurrent: int | None = None,
    dry_run: bool = False,
    include_hero: bool = False,
    tracking_uri: str | None = None,
    root: str | Path | None = None,
    retries: int = 3,
    tracking: bool = True,
    console: Console | None = None,
    show_progress: bool = True,
    local: bool = False,
    ray_timeout: float | None = None,
    rerun_diverged: bool = False,
) -> SubmitResult:
    """Run an experiment's selected specs on Ray; see `ladder submit --help`."""
    t_start = time.perf_counter()
    console = console or Console(stderr=True)
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    root = ledger.ladder_root(root)
    specs = select_specs(exp, only, include_hero, engine)
    planned = plan(root, exp, specs, rerun_diverged)
    result = SubmitResult(exp.name, planned)
    todo = [p for p in planned if p.action == "run"]
    if max_concurrent is not None and max_concurrent < 1:
        raise LadderError(f"--max-concurrent must be at least 1 (got {max_concurrent})")
    if retries < 0:
        raise LadderError(f"--retries must be at least 0 (got {retries})")
    check_memory([p.spec for p in todo])

    if dry_run:
        console.print(plan_table(exp, planned))
        return result
    for p in todo:  # refused before anything trains (and before Ray starts), naming the path
        RunDir(p.run_dir).check_writable()
    if tracking and todo:
        check_store_writable(resolve_tracking_uri(tracking_uri, root))
    for p in planned:
        if p.action == "skip-diverged":
            console.print(f"{p.spec.name}: diverged earlier, not rerun (--rerun-diverged trains it again from its "
                          "newest intact checkpoint)", highlight=False)
    backlog = untracked(root, tracking_uri, planned) if tracking else []
    if not todo:
        n_done = sum(p.action == "skip-finished" for p in planned)
        console.print(f"{exp.name}: all {n_done} selected specs already finished; nothing to train.", highlight=False)
        if backlog:
            catch_up(console, root, tracking_uri, exp, backlog)
        result.wall_s = time.perf_counter() - t_start
        return result

    if local:
        why = infeasible([p.spec for p in todo], local_gpus(), os.cpu_count() or 1)
        if why:
            raise LadderError("refused before training anything, this machine can never run these: " + " | ".join(why))
        hint = resume_hint(exp, only, engine, None, include_hero, tracking_uri, root) + " --local"
        return _sweep(exp, planned, todo, result, root, tracking_uri, tracking, backlog, console, show_progress,
                      t_start, hint, dispatch_local, {})

    import ray

    if not (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
        # the local Ray will have this machine's resources: refuse before paying for its start-up
        check_feasible([p.spec for p in todo], [{"Resources": _local_resources()}])
    stop_ray = _start_ray(address, ray_timeout)
    try:
        check_feasible([p.spec for p in todo], ray.nodes())

        def dispatch(todo, ctx, result, display, mirror):
            _dispatch(todo, ctx, result, display, max_concurrent, retries, mirror)

        hint = resume_hint(exp, only, engine, address, include_hero, tracking_uri, root)
        return _sweep(exp, planned, todo, result, root, tracking_uri, tracking, backlog, console, show_progress,
                      t_start, hint, dispatch, {"sink": progress_sink()})
    finally:
        if stop_ray is not None:
            stop_ray()


def _sweep(exp: Experiment, planned: list[Planned], todo: list[Planned], result: SubmitResult, root: Path,
           tracking_uri: str | None, tracking: bool, backlog: list[Planned], console: Console, show_progress: bool,
           t_start: float, hint: str, dispatch, ctx_extra: dict[str, Any]) -> SubmitResult:
    """Train `todo` through `dispatch(todo, ctx, result, display, mirror)` (Ray tasks, or local
    subprocesses) with the submission's claims owner, MLflow mirror, progress display and summary."""
    for p in todo:
        ledger.write_spec_file(p.run_dir, p.spec)
    owner = uuid.uuid4().hex
    # the environment's engine options are read once, where the submission starts: workers on other
    # nodes get them here, and lay them over each spec's own options section
    ctx: dict[str, Any] = {"root": str(root), "owner": owner, "options": Options.from_env().set_fields(), **ctx_extra}
    mirror = Mirror(console, root, tracking_uri, exp, [p.spec for p in todo], owner) if tracking else None
    if mirror is not None:
        result.tracking_uri, result.parent_run_id = mirror.uri, mirror.parent_run_id
        for p in backlog:  # finished while MLflow was away, or its controller died first
            mirror.ended(p, "finished")
    n_skip = len(planned) - len(todo)
    if n_skip:
        console.print(f"{exp.name}: {n_skip} spec(s) already finished, skipped", highlight=False)
    display = SweepDisplay([(p.spec.id, p.spec.name, p.spec.total_steps) for p in todo], console, show_progress)
    try:
        with display:
            dispatch(todo, ctx, result, display, mirror)
    except KeyboardInterrupt:
        result.interrupted = True
        if mirror is not None:
            mirror.close(result, "KILLED", timeout_s=20)
        console.print(f"interrupted: runs stopped at their last checkpoint. Resume with:\n  {hint}", highlight=False)
        raise
    if mirror is not None:
        mirror.close(result, "FINISHED" if result.ok else "FAILED")
    result.wall_s = time.perf_counter() - t_start
    console.print(summary_table(exp, result), highlight=False)
    behind = [o["name"] for o in result.outcomes.values() if o.get("tracking_synced") is False]
    if behind:
        console.print(
            f"MLflow is missing metrics of {len(behind)} run(s) ({', '.join(behind)}); "
            f"metrics.jsonl has them: run `ladder sync {exp.name}` when the tracking server is back.",
            highlight=False,
        )
    return result


_REMOTE = None


def _launch(p: Planned, ctx: dict, retries: int):
    import ray

    global _REMOTE
    if _REMOTE is None:
        _REMOTE = ray.remote(train_task)  # exported once per driver, not once per spec
    remote = _REMOTE
    res = resources_of(p.spec)
    return remote.options(
        num_cpus=res.get("CPU", 0),
        num_gpus=res.get("GPU", 0),
        max_retries=retries,
        retry_exceptions=False,
        name=f"train:{p.spec.name}",
    ).remote(p.spec.model_dump_json(), str(p.run_dir), ctx)


def _dispatch(
    todo: list[Planned], ctx: dict, result: SubmitResult, display, max_concurrent: int | None, retries: int, mirror
) -> None:
    import ray

    by_id = {p.spec.id: p for p in todo}
    queue = list(todo)
    inflight: dict[Any, Planned] = {}
    deferred: dict[str, Planned] = {}
    last_poll = 0.0
    try:
        while queue or inflight or deferred:
            while queue and (max_concurrent is None or len(inflight) < max_concurrent):
                p = queue.pop(0)
                holder = ledger.live_claim(p.run_dir, p.spec.id)
                if holder is not None and holder.get("owner") != ctx["owner"]:
                    deferred[p.spec.id] = p
                    display.waiting(p.spec.id, f"held by another submission ({holder.get('host')} pid {holder.get('pid')}); waiting")
                    continue
                inflight[_launch(p, ctx, retries)] = p
            if inflight:
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.25)
            else:
                ready = []
                time.sleep(0.25)
            for ref in ready:
                p = inflight.pop(ref)
                out = _outcome(ref, p)
                if out["outcome"] == "busy":
                    deferred[p.spec.id] = p
                    h = out.get("holder") or {}
                    display.waiting(p.spec.id, f"held by another submission ({h.get('host')} pid {h.get('pid')}); waiting")
                    continue
                result.outcomes[p.spec.id] = out
                if mirror is not None and out["outcome"] != "skipped":
                    mirror.ended(p, out["outcome"])
                elif mirror is not None:
                    mirror.adopt(p)
                display.done(p.spec.id, out["outcome"], _note(out))
            for key, upd in _drain(ctx["sink"]).items():
                if mirror is not None and key in by_id and "state" not in upd:
                    mirror.started(by_id[key])  # a worker holds the spec and trains it
                display.update(key, upd)
            if deferred and time.monotonic() - last_poll > DEFER_POLL_S:
                last_poll = time.monotonic()
                for sid, p in list(deferred.items()):
                    if ledger.live_claim(p.run_dir, sid) is not None:
                        continue
                    del deferred[sid]
                    if ledger.is_finished(p.run_dir, p.spec):
                        result.outcomes[sid] = {"spec_id": sid, "name": p.spec.name, "outcome": "skipped", "note": "finished by another submission"}
                        display.done(sid, "skipped", "finished by another submission")
                        if mirror is not None:
                            mirror.adopt(p)
                    else:
                        queue.append(p)
    except KeyboardInterrupt:
        _cancel(inflight, ctx["root"], ctx["owner"])
        for ref, p in inflight.items():
            out = _outcome(ref, p) if ray.wait([ref], timeout=0)[0] else {"outcome": "interrupted"}
            if mirror is not None and mirror.pump.watching(p.spec.id):
                mirror.ended(p, out.get("outcome", "interrupted"))
        raise


def _drain(sink) -> dict:
    """Progress reports since the last call; none while the sink restarts (its node was lost):
    progress is cosmetic, outcomes come from the tasks themselves."""
    import ray

    try:
        return ray.get(sink.drain.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError):
        return {}


def _outcome(ref, p: Planned) -> dict:
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.TaskCancelledError:
        return {"spec_id": p.spec.id, "name": p.spec.name, "outcome": "interrupted", "note": "cancelled"}
    except ray.exceptions.RayTaskError as err:  # the task raised (not a lost worker): say what
        cause = getattr(err, "cause", None)
        what = f"{type(cause).__name__}: {describe(cause)}" if isinstance(cause, BaseException) else type(err).__name__
        return {"spec_id": p.spec.id, "name": p.spec.name, "outcome": "failed", "note": what}
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.RayError) as err:
        return {
            "spec_id": p.spec.id,
            "name": p.spec.name,
            "outcome": "failed",
            "note": f"worker lost after retries ({type(err).__name__}); resubmit resumes from the checkpoint",
        }


def _note(out: dict) -> str:
    bits = []
    if out.get("loss") is not None:
        bits.append(f"loss {out['loss']:.4f}")
    if out.get("note"):
        bits.append(str(out["note"])[:160])
    return "  ".join(bits)


def _cancel(inflight: dict, root: str, owner: str) -> None:
    """Stop every running task and wait a little for them: first by the stop marker its workers
    check at every step (each writes its status, releases its claim and returns), then, for a task
    still running after STOP_GRACE_S (one in a long first step), by ray.cancel (a KeyboardInterrupt
    inside it). Not ray.cancel first: a cancel that races a task's own completion can abort the
    driver inside Ray (task_manager.cc: "Tried to complete task that was not pending", Ray 2.60)."""
    import ray

    refs = list(inflight)
    ledger.request_stop(root, owner)
    try:
        if refs:
            _, refs = ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        for ref in refs:
            try:
                ray.cancel(ref)
            except (ray.exceptions.RayError, ValueError):  # a task already gone, Ray's refusal: the wait covers it
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=15)
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
    finally:
        ledger.clear_stop(root, owner)


# ---- tables ----------------------------------------------------------------------------------------
def summary_table(exp: Experiment, result: SubmitResult) -> Table:
    t = Table(title=f"{exp.name}: {len(result.outcomes)} run(s) in {result.wall_s:.1f}s")
    for col in ("spec", "outcome", "loss", "engine s", "note"):
        t.add_column(col)
    for o in result.outcomes.values():
        loss = o.get("loss")
        t.add_row(
            o.get("name", "?"),
            o.get("outcome", "?"),
            "-" if loss is None else f"{loss:.4f}",
            f"{o.get('engine_s', 0.0):.1f}",
            str(o.get("note") or "")[:80],
        )
    return t
