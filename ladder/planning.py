"""What a submission trains and whether its cluster can: the specs an experiment's selection
names (with an engine override), each one's action from the ledger (run, or skip a finished or
diverged run), its Ray resources, and the refusal of a request no node can ever satisfy (Ray would
leave it pending forever)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from core.spec import Spec
from engines.registry import engine_names
from ladder import ledger
from ladder.errors import LadderError
from ladder.experiment import Experiment
from ladder.train_launch import LaunchError, is_multi_worker
from ladder.train_launch import check_layout as check_workers_layout
from ladder.train_launch import infeasible as workers_infeasible


# ---- plan ----------------------------------------------------------------------------------------
def select_specs(exp: Experiment, only: str | None, include_hero: bool, engine: str | None) -> list[Spec]:
    import re

    if only:
        try:
            re.compile(only)
        except re.error as err:
            raise LadderError(f"--only {only!r} is not a valid regular expression: {err}") from err
    specs = exp.select(only=only, include_hero=include_hero)
    if not specs:
        names = ", ".join(s.name for s in exp.all_specs())
        raise LadderError(f"--only {only!r} matches no spec of experiment {exp.name!r} (specs: {names})")
    if engine:
        if engine not in engine_names():
            raise LadderError(f"unknown engine {engine!r}; registered engines: {', '.join(sorted(engine_names()))}")
        specs = [s.replace(engine=engine) for s in specs]
    return specs


@dataclass
class Planned:
    spec: Spec
    run_dir: Path
    action: str  # run | skip-finished | skip-diverged


def plan(root: Path, exp: Experiment, specs: list[Spec], rerun_diverged: bool = False) -> list[Planned]:
    out = []
    for s in specs:
        d = ledger.run_dir_for(root, exp.name, s)
        if ledger.is_finished(d, s):
            action = "skip-finished"
        elif ledger.read_status(d).get("state") == "diverged" and not rerun_diverged:
            action = "skip-diverged"
        else:
            action = "run"
        out.append(Planned(s, d, action))
    return out


# ---- feasibility -----------------------------------------------------------------------------------
def resources_of(spec: Spec) -> dict[str, float]:
    if is_multi_worker(spec):  # the task only launches its Ray Train job, whose workers hold the resources
        return {}
    need = {"CPU": float(spec.hardware.task_cpus), "GPU": float(spec.hardware.task_gpus)}
    return {k: v for k, v in need.items() if v > 0}


def check_feasible(specs: list[Spec], nodes: list[dict]) -> None:
    """Raise LadderError naming every spec whose per-run resources no single alive node has
    (Ray would leave such a task pending forever)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]
    problems = []
    for s in specs:
        if is_multi_worker(s):
            try:
                check_workers_layout(s)  # a worker count no mesh of the spec can use: refused as well
            except LaunchError as err:
                problems.append(str(err))
                continue
            why = workers_infeasible(s, alive)
            if why:
                problems.append(why)
            continue
        need = resources_of(s)
        if any(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in alive):
            continue
        wants = ", ".join(f"{v:g} {k}" for k, v in need.items())
        missing = []
        for k, v in need.items():
            best = max((res.get(k, 0.0) for res in alive), default=0.0)
            if best < v:
                missing.append(f"no node has {v:g} {k} (largest: {best:g})" if best else f"the cluster has no {k}")
        missing = missing or ["no single node has all of it at once"]
        problems.append(f"spec {s.name} ({s.id}) asks for {wants} per run: {'; '.join(missing)}")
    if problems:
        totals: dict[str, float] = {}
        for res in alive:
            for k in ("CPU", "GPU"):
                totals[k] = totals.get(k, 0.0) + res.get(k, 0.0)
        have = ", ".join(f"{v:g} {k}" for k, v in totals.items())
        raise LadderError(
            "refused before submitting anything, the Ray cluster can never run these: "
            + " | ".join(problems)
            + f" (cluster: {len(alive)} node(s), {have}; change spec.hardware.task_cpus/task_gpus or use another cluster)"
        )


def plan_table(exp: Experiment, planned: list[Planned]) -> Table:
    t = Table(title=f"{exp.name}: plan ({sum(p.action == 'run' for p in planned)} to run)")
    for col in ("spec", "id", "role", "engine", "steps", "resources", "action"):
        t.add_column(col)
    for p in planned:
        res = ", ".join(f"{v:g} {k}" for k, v in resources_of(p.spec).items()) or "-"
        t.add_row(p.spec.name, p.spec.id, p.spec.role, p.spec.engine, str(p.spec.total_steps), res, p.action)
    return t
