"""Runs one torch compute path (the one-device step with the reference kernels or the default ones
on the CPU, the layout's step module over gloo processes: expert parallel alone (dp 1) or a data x expert mesh) for a few steps of a tiny spec on synthetic tokens, and prints its per-step values
as one JSON line: `python -m tests.engines.paths_driver NAME...`. tests/engines/test_torch_paths.py
compares them, bit for bit, with tests/engines/reference/paths.json (`--record` rewrites that
file from the code as it is)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch

from core.spec import Spec
from engines.base import read_metrics, read_status
from engines.options import EngineOptions, TorchKernels
from engines.torch.step import TorchStep
from engines.trainer import Trainer
from ladder.presets import micro_spec
from tests.engines.test_trainer_reference import SyntheticStream

REFERENCE = Path(__file__).parent / "reference" / "paths.json"
KEYS = ("step", "lr", "loss", "grad_norm", "z_loss", "aux_loss", "drop_frac_send", "drop_frac_recv",
        "router_entropy", "expert_load_max", "eval_loss")
TINY = {"data.seq_len": 32, "data.batch_size": 4, "data.total_tokens": 32 * 4 * 6, "run.eval_every": 3,
        "run.eval_batches": 1, "run.checkpoint_every": 100, "model.init_std": 0.3, "model.ep_size": 2}
CAPACITY = {"model.dispatch": "capacity", "model.n_waves": 2, "model.capacity_factor_send": 1.0,
            "model.capacity_factor_recv": 1.0, "model.router_bias_balancing": True, "model.router_bias_rate": 0.01}
SIGMOID = {"model.router_kind": "sigmoid", "model.balance_scope": "sequence", "model.latent_dim": None}
# name -> (spec changes, how it runs: in this process with the "reference" kernels
# (TorchKernels.reference()) or the default ones ("fast"), or "layout" over processes)
PATHS = {
    "reference-dropless": ({}, ("reference", 1)),
    "reference-capacity": ({**CAPACITY, **SIGMOID}, ("reference", 1)),
    "fast-dropless": ({}, ("fast", 1)),
    "fast-capacity": ({**CAPACITY, **SIGMOID}, ("fast", 1)),
    "dp1-ep2-capacity": (CAPACITY, ("layout", 2)),
    "dp1-ep2-dropless": (SIGMOID, ("layout", 2)),
    "dp2-ep2-capacity": (CAPACITY, ("layout", 4)),
}


def spec_of(name: str) -> Spec:
    return micro_spec(name, **TINY, **PATHS[name][0])


def _values(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in KEYS} for r in read_metrics(run_dir)]


DISPATCHERS: dict[str, str] = {}  # name -> the token dispatcher its run recorded in status.json


def _note_dispatcher(name: str, run_dir: Path) -> None:
    DISPATCHERS[name] = read_status(run_dir)["options"].get("torch_dispatch")


KERNELS = {"reference": TorchKernels.reference(), "fast": TorchKernels()}


def _worker(kind: str, rank: int, world: int, port: int, spec_json: str, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    spec = Spec.model_validate_json(spec_json)
    code = 0
    try:
        from engines.torch.parallel.layout import setup_layout
        from engines.torch.parallel.step import ParallelTrainer

        layout = setup_layout(spec.model, spec.data.batch_size, "cpu")
        module = TorchStep(spec, layout.device, EngineOptions(), layout=layout, run_dir=Path(run_dir), dense="fsdp")
        list(ParallelTrainer(spec, run_dir, module, checkpoints=False, stream=SyntheticStream(spec)).fit())
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 (the driver reports the exit code)
        print(f"rank {rank}: {err!r}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(name: str) -> list[dict]:
    spec = spec_of(name)
    kind, world = PATHS[name][1]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / name
        if kind in ("reference", "fast"):
            torch.set_num_threads(1)
            module = TorchStep(spec, torch.device("cpu"), EngineOptions(torch_kernels=KERNELS[kind]))
            list(Trainer(spec, run_dir, module, checkpoints=False, stream=SyntheticStream(spec)).fit())
            _note_dispatcher(name, run_dir)
            return _values(run_dir)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [mp.get_context("fork").Process(target=_worker, args=(kind, r, world, port, spec.model_dump_json(),
                                                                      str(run_dir)))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        codes = [p.exitcode for p in procs]
        if codes != [0] * world:
            raise RuntimeError(f"{name}: ranks exited {codes}")
        _note_dispatcher(name, run_dir)
        return _values(run_dir)


if __name__ == "__main__":
    if sys.argv[1] == "--record":
        REFERENCE.write_text(json.dumps(
            {"about": "Per-step values of tiny CPU runs (one thread per process, synthetic tokens) of each torch "
                      "compute path: the one-device step with the reference kernels and the default ones, and "
                      "the layout's step module over processes; tests/engines/test_torch_paths.py pins them "
                      "bit for bit.",
             **{name: run(name) for name in PATHS}}, indent=1) + "\n")
    else:
        values = {name: run(name) for name in sys.argv[1:]}
        print(json.dumps({"values": values, "dispatchers": DISPATCHERS}))
