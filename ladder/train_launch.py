"""One spec over several processes, launched by Ray Train.

A spec whose hardware.workers > 1 runs as a TorchTrainer job: hardware.workers workers, each
with hardware.task_cpus CPUs and hardware.task_gpus GPUs, placed by hardware.placement (a Ray
placement strategy: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). Ray Train starts the process
group (gloo on CPUs, NCCL on GPUs); each worker runs engines.torch.parallel.step.train_layout on the
(data x expert) mesh, rank 0 writes the run directory as a one-process run does (metrics.jsonl,
status.json), and every rank writes its shards of each checkpoint. The run directory must be on
storage every node sees (one machine, or a shared file system).

Stopping. When the consumer of train_on_workers stops early (a cancelled task, Ctrl-C), it writes
run_dir/workers/stop; rank 0 reads it after each step and every rank leaves after that same step,
so the job ends and leaves no writer behind (the newest checkpoint is the resume point).

Failures. FailureConfig(max_failures) restarts the whole worker group after a worker or node is
lost; the restarted workers resume from the newest sharded checkpoint in the run directory, so a
killed worker costs the steps since that checkpoint and ends in the same weights.

The controller's worker task (ladder/controller.py train_task) yields from train_on_workers
instead of an engine's train() for such a spec; it reads rank 0's metrics.jsonl as it grows, so
progress, tracking, claims and the ledger are those of any other run. A request the cluster can
never satisfy is refused before anything starts (infeasible). Standalone, without Ray:
`torchrun --nproc_per_node N -m engines.torch.parallel.train SPEC --run-dir DIR`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

from core.errors import InputError
from core.rundir import METRICS_FILE, parse_metrics_lines
from core.spec import Spec
from engines.base import StepMetrics
from engines.checkpoint import CHECKPOINTS, latest_checkpoint
from engines.torch.parallel.sharded import SHARDED, latest_sharded
from engines.options import EngineOptions

MAX_FAILURES = 3
POLL_S = 0.5
WORKERS_DIR = "workers"  # rank<r>.json: where each worker of the newest attempt ran
STOP_FILE = "stop"  # written when the launcher's consumer goes away: the workers leave after a step
STOP_WAIT_S = 60.0


class LaunchError(InputError):
    """A multi-worker spec that cannot be launched; the message says why."""


def is_multi_worker(spec: Spec) -> bool:
    return spec.hardware.workers > 1


def per_worker(spec: Spec) -> dict[str, float]:
    hw = spec.hardware
    need = {"CPU": float(hw.task_cpus), "GPU": float(hw.task_gpus)}
    return {k: v for k, v in need.items() if v > 0}


def check_layout(spec: Spec) -> None:
    """The workers form a (data x expert) mesh of the torch engine, or LaunchError."""
    from engines.torch.parallel.layout import LayoutError, check_layout as check_torch_layout

    if spec.engine != "torch":
        raise LaunchError(f"spec {spec.name}: hardware.workers {spec.hardware.workers} needs engine torch "
                          f"(the {spec.engine} engine runs in one process: set hardware.workers to 1)")
    try:
        check_torch_layout(spec.model, spec.hardware.workers, spec.data.batch_size)
    except LayoutError as err:
        raise LaunchError(f"spec {spec.name}: {err} (hardware.workers)") from err


def infeasible(spec: Spec, nodes: list[dict]) -> str | None:
    """Why the alive nodes can never hold this spec's workers under its placement, or None."""
    need = per_worker(spec)
    n, how = spec.hardware.workers, spec.hardware.placement
    fits = [min((int(res.get(k, 0.0) // v) for k, v in need.items()), default=n) for res in nodes]
    if how == "STRICT_PACK":
        ok = max(fits, default=0) >= n
        where = "one node"
    elif how == "STRICT_SPREAD":
        ok = sum(1 for f in fits if f >= 1) >= n
        where = f"{n} different nodes"
    else:
        ok = sum(fits) >= n
        where = "the cluster"
    if ok:
        return None
    wants = ", ".join(f"{v:g} {k}" for k, v in need.items()) or "nothing"
    room = sum(fits) if how != "STRICT_PACK" else max(fits, default=0)
    if how == "STRICT_SPREAD":
        room = sum(1 for f in fits if f >= 1)
    return (f"spec {spec.name} ({spec.id}) asks for {n} workers of {wants} ({how}): {where} has room for "
            f"{room} (nodes: {len(nodes)}; change spec.hardware.workers/task_cpus/task_gpus/placement)")


def _worker_loop(config: dict) -> None:
    """Runs in each Ray Train worker: the mesh run of the spec, resumed from its newest checkpoint."""
    import ray.train
    import torch
    import torch.distributed as dist

    from engines.torch.parallel.layout import setup_layout
    from engines.torch.parallel.step import train_layout

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(ctx.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()))
    spec = Spec.model_validate_json(config["spec"])
    run_dir = Path(config["run_dir"])
    where = run_dir / WORKERS_DIR
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(), "time": time.time()}))
    layout = setup_layout(spec.model, spec.data.batch_size, "cuda" if config["gpu"] else "cpu")
    stop = run_dir / WORKERS_DIR / STOP_FILE
    steps = train_layout(spec, run_dir, layout, resume=True, options=EngineOptions.from_dict(config["options"]))
    for _ in steps:
        # every rank leaves after the same step: rank 0's view of the stop file, shared
        flag = torch.tensor([float(layout.rank == 0 and stop.exists())])
        dist.all_reduce(flag)
        if flag.item() > 0:
            steps.close()  # the newest checkpoint stays the run's resume point
            break
    dist.barrier()


def trainer_for(spec: Spec, run_dir: Path, max_failures: int = MAX_FAILURES, options: EngineOptions | None = None):
    """The TorchTrainer of a multi-worker spec (not started); options: the engine options its
    workers train under (default: the spec's options section)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    hw = spec.hardware
    gpu = hw.task_gpus > 0
    scaling = ScalingConfig(num_workers=hw.workers, use_gpu=gpu, resources_per_worker=per_worker(spec) or None,
                            placement_strategy=hw.placement)
    run = RunConfig(name=f"{spec.name}-{spec.id}", storage_path=str((run_dir / "ray_train").resolve()),
                    failure_config=FailureConfig(max_failures=max_failures))
    config = {"spec": spec.model_dump_json(), "run_dir": str(run_dir.resolve()), "gpu": gpu,
              "options": (options or EngineOptions.for_spec(spec)).to_dict()}
    return TorchTrainer(_worker_loop, train_loop_config=config, torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
                        scaling_config=scaling, run_config=run)


def _read_records(path: Path, offset: int, next_step: int) -> tuple[list[StepMetrics], int]:
    """Complete records after byte `offset` from step `next_step` on (a restart truncates the file
    to its checkpoint and writes the same steps again: those already read are passed over)."""
    if not path.exists():
        return [], offset
    if path.stat().st_size < offset:
        offset = 0
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    out = []
    for line in chunk[: chunk.rfind(b"\n") + 1].splitlines(keepends=True):
        got = parse_metrics_lines(line, path, warn=None)
        if not got and line.strip():  # a bad line: say where (counting lines only then)
            with open(path, "rb") as f:
                parse_metrics_lines(line, path, first_line=f.read(offset).count(b"\n") + 1)
        offset += len(line)
        rec = got[0] if got else None
        if rec is not None and rec.get("step") == next_step:
            out.append(StepMetrics.from_dict(rec))
            next_step += 1
    return out, offset


def train_on_workers(spec: Spec, run_dir: str | Path, resume: bool = True, max_failures: int = MAX_FAILURES,
                     options: EngineOptions | None = None) -> Iterator[StepMetrics]:
    """Run the spec as a Ray Train job on the connected Ray cluster; yield each step's record as
    rank 0 writes it. Raises LaunchError for a layout that cannot work, RuntimeError when the job
    fails more than max_failures times."""
    import ray

    check_layout(spec)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    why = infeasible(spec, [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)])
    if why:
        raise LaunchError(why)
    if not resume:
        for d in (SHARDED, CHECKPOINTS):
            shutil.rmtree(run_dir / d, ignore_errors=True)
    metrics = run_dir / METRICS_FILE
    found = [int(p.name[5:]) for p in (latest_sharded(run_dir), latest_checkpoint(run_dir)) if p is not None]
    next_step = max(found, default=0)  # where the workers resume; earlier records are passed over
    offset = 0
    stop = run_dir / WORKERS_DIR / STOP_FILE
    stop.unlink(missing_ok=True)
    box: dict = {}

    def fit() -> None:
        try:
            box["result"] = trainer_for(spec, run_dir, max_failures, options).fit()
        except BaseException as err:  # TrainingFailedError and the like: re-raised below
            box["error"] = err

    thread = threading.Thread(target=fit, name=f"ray-train:{spec.name}", daemon=True)
    thread.start()
    try:
        while True:
            done = not thread.is_alive()
            recs, offset = _read_records(metrics, offset, next_step)
            for rec in recs:
                next_step = rec.step + 1
                yield rec
            if done:
                break
            time.sleep(POLL_S)
    finally:
        if thread.is_alive():  # the consumer stopped early (a cancelled task, Ctrl-C): end the job
            stop.parent.mkdir(parents=True, exist_ok=True)
            stop.write_text(f"{time.time()}\n")
            thread.join(STOP_WAIT_S)
    if "error" in box:
        raise RuntimeError(f"Ray Train job of spec {spec.name} failed: {box['error']}") from box["error"]
    result = box.get("result")
    if result is not None and getattr(result, "error", None):
        raise RuntimeError(f"Ray Train job of spec {spec.name} failed: {result.error}")
