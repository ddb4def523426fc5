"""What the fixed eval set costs a run: a periodic eval and the final eval against the train steps
they sit between, on the engine's own step module (engines/torch/engine.TorchStep).

    python bench/eval_cost.py --experiment experiments/proxy_h200.py --spec hero-d512 --steps 30 [--paths engine,reference]

The eval set's shape comes from the spec (run.eval_batches groups of 8 windows a source
periodically, every window at the end, windows of eval_seq_len + 1 tokens); the tokens are random
ids of the spec's vocabulary, which is all a timing needs, so no corpus has to be built. Prints,
for each eval path (the engine's kernels, the reference kernels: TorchKernels.reference()) and
their values' agreement, the median train step, one periodic eval, the final eval, and the share of the run's time periodic evals take at the spec's cadence
(run.eval_every). Device events time every region; the numbers are ratios within one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from engines.data import EVAL_ROWS, eval_seq_len
from engines.evalset import eval_windows
from engines.torch.engine import TorchStep, default_device
from engines.options import TorchKernels
from engines.torch.forward import Forward
from engines.torch.step import eval_losses
from ladder.experiment import load_experiment


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="experiments/proxy_h200.py")
    ap.add_argument("--spec", default="hero-d512")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--paths", default="engine,reference", help="eval paths to compare: the engine's kernels "
                    "and the reference kernels (TorchKernels.reference(), eager), rows in training-batch forwards")
    ap.add_argument("--source-tokens", default="116e6,98e6,4.8e6", help="tokens of each source (sets the final eval's size)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    spec = load_experiment(args.experiment).by_name(args.spec)
    device = default_device()
    step = TorchStep(spec, device)
    step.init_fresh()
    rng = np.random.default_rng(0)
    B, S, V = spec.data.batch_size, spec.data.seq_len, spec.model.vocab_size
    L = eval_seq_len(spec.data)
    sizes = [float(x) for x in args.source_tokens.split(",")]
    final_groups = sum(eval_windows(int(n), spec.data.eval_tokens, spec.data.eval_fraction, L + 1) for n in sizes) // EVAL_ROWS
    periodic_groups = spec.run.eval_batches * len(sizes)

    def batches(k: int) -> list[np.ndarray]:
        return [rng.integers(0, V, (EVAL_ROWS, L + 1), dtype=np.int32) for _ in range(k)]

    train = [rng.integers(0, V, (B, S + 1), dtype=np.int32) for _ in range(4)]
    times = []
    for i in range(args.steps + 3):
        dt = _timed(lambda: step.read(step.launch(i, train[i % 4], 1e-4)), device)
        if i >= 3:
            times.append(dt)
    step_s = statistics.median(times)
    evals_per_run = spec.total_steps // spec.run.eval_every
    rows = []
    for path in args.paths.split(","):
        if path not in ("engine", "reference"):
            raise SystemExit(f"--paths: unknown path {path!r} (engine, reference)")
        loss = step.loss_fn if path == "engine" else Forward(device, TorchKernels.reference())
        run = lambda b: eval_losses(loss, step.model, b, B, device)  # noqa: E731
        probe = batches(periodic_groups)
        values = run(probe)  # warm-up at this shape (and the values both paths are compared on)
        per = statistics.median(_timed(lambda: run(batches(periodic_groups)), device) for _ in range(5))
        fin = _timed(lambda: run(batches(final_groups)), device)
        share = evals_per_run * per / (spec.total_steps * step_s)
        rows.append({"spec": spec.name, "device": str(device), "path": path, "train_step_ms": 1e3 * step_s,
                     "periodic_groups": periodic_groups, "periodic_eval_ms": 1e3 * per, "final_groups": final_groups,
                     "final_eval_s": fin, "periodic_share_of_run": share, "mean_ce": float(np.mean(values)),
                     "probe_losses": values})
    if len(rows) == 2:
        a, b = (np.array(r["probe_losses"]) for r in rows)
        print(f"engine vs reference kernels on the same batches: max relative difference {np.max(np.abs(a / b - 1)):.2e}, "
              f"mean {np.mean(a / b - 1):+.2e}")
    print(f"{'path':>9} {'step ms':>8} {'periodic ms':>12} {'final s':>8} {'periodic share':>15}")
    for r in rows:
        print(f"{r['path']:>9} {r['train_step_ms']:>8.1f} {r['periodic_eval_ms']:>12.1f} {r['final_eval_s']:>8.2f} "
              f"{100 * r['periodic_share_of_run']:>14.2f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
