"""Expert parallel over several GPUs of one host (PyTorch engine, one process per GPU, NCCL)
against one GPU running the same spec with the EP shards emulated.

    PYTHONPATH=. python3 bench/ep_multi_gpu.py                     # EP = 1, 2, 4, 8 as the GPUs allow
    PYTHONPATH=. python3 bench/ep_multi_gpu.py --ep 8 --steps 40   # one EP size (runs are appended)
    PYTHONPATH=. python3 bench/ep_multi_gpu.py --engine jax --ep 2  # the JAX engine's device mesh
    PYTHONPATH=. python3 bench/ep_multi_gpu.py --table-only        # rebuild the table from results.jsonl

For each EP size k the spec's model.ep_size is k (so the capacities, and the drops, are those of
k shards) and two runs train on the same real-text batches from step 0:
- `ep`: `python -m torch.distributed.run --nproc_per_node k -m engines.torch.parallel.train` (one
  process per GPU, experts resident on their GPU, pooled-wave all_to_all_single per wave);
- `single`: one GPU with the engine's own train step (engines/torch/step.py launch_step +
  finish_step: the forward of engines/torch/forward.py), the k shards emulated.
With `--engine jax` the same two runs use the JAX engine's jitted step: `ep` in a process that
sees k GPUs, whose 1-D mesh shards the routed experts (and their moments) and runs the pooled-wave
jax.lax.all_to_all between them, the rest data-parallel; `single` in a process that sees one GPU,
the k shards emulated. (EP 1 is the same program both ways, so JAX starts at EP 2.)
Columns: tokens/s of the step over all GPUs (steps after --warmup; compilation excluded), per
GPU, against the single GPU; drop fractions (mean over the timed steps); peak memory per GPU
(max over ranks of torch.cuda.max_memory_allocated); the largest relative gap of the loss curves
(every step) and the steps whose drop counts differ. NCCL_NVLS_ENABLE=0 (and the other
multicast switches) stay set for every process.

With no GPU it runs the same thing with gloo CPU processes on a tiny model as a functional check
and says so: those tokens/s measure nothing about GPUs.

Results are appended to <out>/results.jsonl as each run finishes; <out>/table.md and
<out>/loss_curves.png are rebuilt from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.schedule import lr_at  # noqa: E402
from core.rundir import METRICS_FILE  # noqa: E402
from core.spec import Spec, load_spec, save_spec  # noqa: E402
from engines.data import TokenStream  # noqa: E402
from engines.options import EngineOptions  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():
    os.environ.setdefault(_k, _v)

SOURCES = [{"name": "code", "builtin": "python_code", "weight": 0.7},
           {"name": "docs", "builtin": "python_docs", "weight": 0.3}]

# expert-heavy, so sharding the experts shows in memory: 64 experts top-8 in a latent of d/2,
# 12 layers of d 1024 (about 0.68B parameters, 0.6B of them routed experts)
GPU_MODEL = {"n_layers": 12, "d_model": 1024, "n_heads": 16, "n_kv_heads": 4, "head_dim": 64, "vocab_size": 256,
             "n_routed_experts": 64, "top_k": 8, "n_shared_experts": 2, "expert_hidden": 512, "shared_hidden": 512,
             "latent_dim": 512, "dispatch": "capacity", "capacity_factor_send": 1.25, "capacity_factor_recv": 1.25,
             "n_waves": 3, "attention_window": None}
GPU_DATA = {"seq_len": 2048, "batch_size": 32}
CPU_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 256,
             "n_routed_experts": 16, "top_k": 2, "n_shared_experts": 1, "expert_hidden": 32, "shared_hidden": 64,
             "latent_dim": 32, "dispatch": "capacity", "capacity_factor_send": 1.0, "capacity_factor_recv": 1.0,
             "n_waves": 2, "attention_window": None, "init_std": 0.3}  # routed outputs big enough to move the loss
CPU_DATA = {"seq_len": 128, "batch_size": 8}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_spec(ep: int, steps: int, gpu: bool, capacity_factor: float | None = None, batch: int | None = None,
              peak_lr: float = 2e-3, warmup_frac: float = 0.1):
    model, data = (GPU_MODEL, GPU_DATA) if gpu else (CPU_MODEL, CPU_DATA)
    if capacity_factor is not None:
        model = {**model, "capacity_factor_send": capacity_factor, "capacity_factor_recv": capacity_factor}
    if batch is not None:
        data = {**data, "batch_size": batch}
    tokens = data["seq_len"] * data["batch_size"] * steps
    return Spec.model_validate({
        "name": f"ep-bench-{'gpu' if gpu else 'cpu'}", "engine": "torch", "seed": 0,
        "model": {**model, "ep_size": ep},
        "data": {"sources": SOURCES, **data, "total_tokens": tokens},
        "optim": {"peak_lr": peak_lr, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "grad_clip": 1.0,
                  "z_loss": 1e-4, "aux_loss": 1e-2},
        "schedule": {"warmup_frac": warmup_frac, "decay": "linear", "min_lr_ratio": 0.05},
        "hardware": {"system": "h200" if gpu else "cpu", "n_gpus": ep if gpu else 0, "peak_flops": 989e12 if gpu else 1e12},
        "run": {"checkpoint_every": 10**9, "eval_every": 10**9, "eval_batches": 1},
        "options": {} if gpu else {"cpu_threads": 1},  # the engines' options, set here (no environment)
    })


# ---- the single-device reference (run in its own process) --------------------------------------------


def _timed_rows(spec, run_step) -> list[dict]:
    """Every step of the spec on its batches at its LR schedule: run_step(batch, lr) -> (host
    metrics, finite) returns once the step is done. Per step loss, drops, tokens and seconds;
    the first step that is not finite is the last."""
    import numpy as np

    stream = TokenStream.from_spec(spec)
    lrs = lr_at(spec, np.arange(spec.total_steps))
    rows = []
    t_prev = time.perf_counter()
    for step in range(spec.total_steps):
        batch = stream.batch(step)
        m, finite = run_step(batch, float(lrs[step]))
        now = time.perf_counter()
        rows.append({"step": step, "loss": m["loss"], "drop_frac_send": m["drop_frac_send"],
                     "drop_frac_recv": m["drop_frac_recv"], "seconds": now - t_prev,
                     "tokens": batch.shape[0] * (batch.shape[1] - 1)})
        t_prev = now
        if not finite:
            break
    return rows


def single_run(spec_path: Path, out_path: Path, device_name: str) -> None:
    """The torch engine's step module (engines/torch/step.TorchStep) on one device for every step
    of the spec (no checkpoints): per step loss, drops, seconds; peak memory."""
    import torch

    from engines.torch.step import TorchStep, cpu_threads

    spec = load_spec(spec_path)
    device = torch.device(device_name)
    options = EngineOptions.for_spec(spec)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(spec, options) or 1)
    step = TorchStep(spec, device, options)
    step.init_fresh()

    def run_step(batch, lr):
        return step.read(step.launch(0, batch, lr))  # its host read waits for the step

    rows = _timed_rows(spec, run_step)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_peak()
    out_path.write_text(json.dumps({"rows": rows, "peak_memory_bytes": [int(peak)],
                                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}))


def jax_run(spec_path: Path, out_path: Path) -> None:
    """The JAX engine's step module (JaxEngine.step_module: the mesh when this process sees
    ep_size devices, else the shards emulated on one) for every step of the spec at its LR
    schedule, each step read before the next: per step loss, drops, seconds; peak memory."""
    import jax

    from engines.jax.engine import JaxEngine

    spec = load_spec(spec_path)
    step = JaxEngine(EngineOptions.for_spec(spec)).step_module(spec)
    gpu, mesh = jax.default_backend() == "gpu", step.mesh
    if spec.model.ep_size > 1 and (mesh is None) != (len(jax.devices()) == 1):
        raise SystemExit(f"{len(jax.devices())} devices visible for ep_size {spec.model.ep_size}: "
                         "want ep_size (a mesh) or 1 (shards emulated)")
    step.init_fresh()

    def run_step(batch, lr):
        return step.read(step.launch(0, batch, lr))  # waits for the step

    rows = _timed_rows(spec, run_step)
    devices = mesh.devices.ravel().tolist() if mesh is not None else jax.devices()[:1]
    peaks = [int((d.memory_stats() or {}).get("peak_bytes_in_use", 0)) for d in devices] if gpu else [_rss_peak()]
    out_path.write_text(json.dumps({"rows": rows, "peak_memory_bytes": peaks, "n_devices": len(devices),
                                    "device": devices[0].device_kind if gpu else "cpu"}))


def _rss_peak() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ---- runs ------------------------------------------------------------------------------------------


def _env(gpu: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **NO_MULTICAST)
    if not gpu:
        env.update(OMP_NUM_THREADS="1")
    return env


def _summarise(kind: str, ep: int, rows: list[dict], peaks: list[int], warmup: int, device: str, wall: float,
               engine: str = "torch") -> dict:
    timed = rows[warmup:] or rows
    tok = sum(r["tokens"] for r in timed)
    sec = sum(r["seconds"] for r in timed)
    return {
        "engine": engine, "kind": kind, "ep": ep, "device": device, "steps": len(rows), "timed_steps": len(timed),
        "tokens_per_s": tok / sec if sec > 0 else 0.0,
        "drop_frac_send": sum(r["drop_frac_send"] for r in timed) / len(timed),
        "drop_frac_recv": sum(r["drop_frac_recv"] for r in timed) / len(timed),
        "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "peak_memory_gib_per_rank": [p / 2**30 for p in peaks],
        "losses": [r["loss"] for r in rows],
        "drops": [[r["drop_frac_send"], r["drop_frac_recv"]] for r in rows],
        "wall_s": wall, "time": time.time(),
    }


def run_ep(ep: int, spec_path: Path, run_dir: Path, gpu: bool, warmup: int, timeout: float) -> dict:
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ep),
           "-m", "engines.torch.parallel.train", str(spec_path), "--run-dir", str(run_dir), "--no-checkpoints",
           "--log-every", "10", "--device", "cuda" if gpu else "cpu"]
    log("ep", ep, ":", " ".join(cmd[1:]))
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(gpu), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"EP {ep} exited {proc.returncode}: {proc.stderr[-3000:]}")
    recs = [json.loads(l) for l in (run_dir / METRICS_FILE).read_text().splitlines()]
    rows = [{"step": r["step"], "loss": r["loss"], "drop_frac_send": r["drop_frac_send"],
             "drop_frac_recv": r["drop_frac_recv"], "tokens": 0, "seconds": 0.0} for r in recs]
    prev = 0
    for row, r in zip(rows, recs):
        row["tokens"] = r["tokens"] - prev
        prev = r["tokens"]
        row["seconds"] = row["tokens"] / r["tokens_per_s"]
    summary = json.loads((run_dir / "mesh.json").read_text())
    peaks = [r["peak_memory_bytes"] for r in summary["ranks"]]
    out = _summarise("ep", ep, rows, peaks, warmup, summary["ranks"][0]["device"], wall)
    out["backend"] = summary["backend"]
    out["expert_params_per_rank"] = summary["ranks"][0]["expert_params"]
    out["dense_params_per_rank"] = summary["ranks"][0]["dense_params"]
    return out


def run_single(ep: int, spec_path: Path, run_dir: Path, gpu: bool, warmup: int, timeout: float) -> dict:
    log("single, ep_size", ep, "emulated")
    out_path = run_dir / "single.json"
    res, wall = _run_child(f"single (ep_size {ep})", ["--single-run", str(spec_path), str(out_path), "--device",
                                                      "cuda" if gpu else "cpu"], out_path, _env(gpu), timeout)
    return _summarise("single", ep, res["rows"], res["peak_memory_bytes"], warmup, res["device"], wall)


def _run_child(label: str, args: list[str], out_path: Path, env: dict, timeout: float) -> tuple[dict, float]:
    """This script with `args` in a subprocess that writes out_path: (its JSON, wall seconds)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{label} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(out_path.read_text()), wall


def _jax_env(gpu: bool, n_devices: int) -> dict:
    env = _env(gpu)
    if gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n_devices)))
        # one device holding every emulated shard needs more than XLA's default 75% pool
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    else:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n_devices}".strip()
    return env


def run_jax(kind: str, ep: int, spec_path: Path, run_dir: Path, gpu: bool, warmup: int, timeout: float) -> dict:
    """`ep`: a process that sees ep devices (the mesh); `single`: one that sees one."""
    n_devices = ep if kind == "ep" else 1
    log(f"jax {kind}, ep_size {ep} over {n_devices} device(s)")
    out_path = run_dir / "jax.json"
    res, wall = _run_child(f"jax {kind} (ep_size {ep})", ["--jax-run", str(spec_path), str(out_path)], out_path,
                           _jax_env(gpu, n_devices), timeout)
    if res["n_devices"] != n_devices:
        raise RuntimeError(f"jax {kind} (ep_size {ep}) ran on {res['n_devices']} devices, not {n_devices}")
    return _summarise(kind, ep, res["rows"], res["peak_memory_bytes"], warmup, res["device"], wall, "jax")


# ---- report -----------------------------------------------------------------------------------------


def load_results(out: Path) -> dict[tuple[str, str, int, bool], dict]:
    """The latest result of each (engine, kind, ep, on a GPU)."""
    latest = {}
    path = out / "results.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            latest[(r.get("engine", "torch"), r["kind"], r["ep"], r["device"] != "cpu")] = r
    return latest


def write_table(out: Path) -> str:
    res = load_results(out)
    lines = []
    for gpu in (True, False):
        for engine in ("torch", "jax"):
            eps = sorted({ep for (eng, kind, ep, g) in res if g == gpu and eng == engine})
            if not eps:
                continue
            any_row = next(r for (eng, k, e, g), r in res.items() if g == gpu and eng == engine)
            where = any_row["device"] if gpu else "CPU processes (gloo), tiny model: a functional check, no GPU measured"
            if engine == "jax":
                where = (f"JAX engine, {any_row['device']}" if gpu
                         else "JAX engine, emulated CPU devices, tiny model: a functional check, no GPU measured")
            unit = "GPU" if gpu else ("process" if engine == "torch" else "device")
            lines += [f"### {where}", "",
                      f"| EP | {unit}{'es' if unit == 'process' else 's'} | tokens/s (all) | tokens/s per {unit} | vs 1 {unit} (same spec) | drop send "
                      f"| drop recv | peak GiB per {unit} | 1-{unit} peak GiB | max rel. loss gap | steps with other drops |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for ep in eps:
                e, s = res.get((engine, "ep", ep, gpu)), res.get((engine, "single", ep, gpu))
                if e is None:
                    continue
                head = (f"| {ep} | {ep} | {e['tokens_per_s']:,.0f} | {e['tokens_per_s'] / ep:,.0f} ")
                tail = f"| {e['drop_frac_send']:.4f} | {e['drop_frac_recv']:.4f} | {e['peak_memory_gib']:.2f} "
                if s is None:
                    lines.append(head + "| - " + tail + "| - | - | - |")
                    continue
                n = min(len(e["losses"]), len(s["losses"]))
                gap = max(abs(a - b) / abs(b) for a, b in zip(e["losses"][:n], s["losses"][:n]))
                other = sum(1 for a, b in zip(e["drops"][:n], s["drops"][:n]) if a != b)
                lines.append(head + f"| {e['tokens_per_s'] / s['tokens_per_s']:.2f}x " + tail
                             + f"| {s['peak_memory_gib']:.2f} | {gap:.2e} | {other}/{n} |")
            lines.append("")
            lines.append(f"One {unit}, same spec (shards emulated), tokens/s: " + ", ".join(
                f"ep_size {ep}: {res[(engine, 'single', ep, gpu)]['tokens_per_s']:,.0f}"
                for ep in eps if (engine, "single", ep, gpu) in res))
            lines.append("")
    text = "\n".join(lines)
    (out / "table.md").write_text(text + "\n")
    _plot(res, out)
    return text


def _plot(res: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for (engine, kind, ep, gpu), r in sorted(res.items()):
        ax.plot(r["losses"], label=f"{'GPU' if gpu else 'CPU'} {engine} {kind} ep={ep}",
                linestyle="-" if kind == "ep" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", default=None, help="EP sizes, comma-separated (default 1,2,4,8 up to the GPU count)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40 on GPUs, 8 on the CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 10 on GPUs, 2 on the CPU)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "ep_multi_gpu")
    p.add_argument("--engine", default="torch", help="torch, jax or torch,jax (default torch)")
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU reference runs")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="both capacity factors (default 1.25); E/top_k drops nothing, to compare losses at zero drops")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 32 on GPUs)")
    p.add_argument("--peak-lr", type=float, default=2e-3, help="the spec's peak learning rate (default 2e-3)")
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="the share of the steps spent warming up (default 0.1); a longer warm-up keeps bf16 "
                        "curves from parting in the first steps")
    p.add_argument("--no-ep", action="store_true", help="skip the EP runs (only the single-GPU references)")
    p.add_argument("--cpu", action="store_true", help="the gloo CPU check even where GPUs exist")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--single-run", nargs=2, type=Path, metavar=("SPEC", "OUT_JSON"), help=argparse.SUPPRESS)
    p.add_argument("--jax-run", nargs=2, type=Path, metavar=("SPEC", "OUT_JSON"), help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single_run:
        single_run(*args.single_run, args.device)
        return 0
    if args.jax_run:
        jax_run(*args.jax_run)
        return 0
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    if not engines or set(engines) - {"torch", "jax"}:
        p.error(f"--engine {args.engine!r}: choose from torch, jax")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table_only:
        print(write_table(args.out))
        return 0

    import torch

    n_gpus = 0 if args.cpu else torch.cuda.device_count()
    gpu = n_gpus > 0
    if not gpu:
        log("no GPU here: running gloo CPU processes on a tiny model, a functional check that measures no GPU")
    limit = n_gpus if gpu else max(os.cpu_count() or 1, 4)
    wanted = [int(x) for x in args.ep.split(",")] if args.ep else ([1, 2, 4, 8] if gpu else [1, 2, 4])
    steps = args.steps or (40 if gpu else 8)
    warmup = args.warmup if args.warmup is not None else (10 if gpu else 2)
    skipped = []
    for ep in wanted:
        if ep > limit:
            skipped.append(ep)
            log(f"EP {ep}: skipped, this machine has {n_gpus} GPU(s)")
            continue
        spec = make_spec(ep, steps, gpu, args.capacity_factor, args.batch, args.peak_lr, args.warmup_frac)
        spec_path = args.out / f"spec_ep{ep}_{'gpu' if gpu else 'cpu'}.yaml"
        save_spec(spec, spec_path)
        for engine in engines:
            if engine == "jax" and ep == 1:
                log("jax EP 1: skipped, the same program as its single-device reference")
                continue
            for kind in ("ep", "single"):
                if (kind == "single" and args.no_single) or (kind == "ep" and args.no_ep):
                    continue
                run_dir = args.out / f"{engine}_{kind}_ep{ep}_{'gpu' if gpu else 'cpu'}"
                try:
                    if engine == "jax":
                        r = run_jax(kind, ep, spec_path, run_dir, gpu, warmup, args.timeout)
                    else:
                        r = (run_ep if kind == "ep" else run_single)(ep, spec_path, run_dir, gpu, warmup, args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    log(f"{engine} {kind} ep {ep} failed: {err}")
                    continue
                with open(args.out / "results.jsonl", "a") as f:
                    f.write(json.dumps(r) + "\n")
                log(f"{engine} {kind} ep={ep}: {r['tokens_per_s']:,.0f} tok/s, drops {r['drop_frac_send']:.4f}/"
                    f"{r['drop_frac_recv']:.4f}, peak {r['peak_memory_gib']:.2f} GiB, wall {r['wall_s']:.0f}s")
    print(write_table(args.out))
    if skipped:
        print(f"not run: EP {', '.join(map(str, skipped))} (needs that many GPUs; this machine has {n_gpus})")
    if not gpu:
        print("no GPU measured: the rows above are gloo CPU processes on a tiny model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
