"""Tokens/s and MFU of the JAX engine on a spec of experiments/proxy_h200.py (bf16 matmuls on a
GPU, fp32 weights), the same measurement as bench/torch_throughput.py.

    python bench/jax_throughput.py --rung d512 --steps 40 [--dispatch capacity|dropless]

Trains the rung for --steps steps (its schedule re-timed to that many steps; throughput does not
depend on the LR), with no eval or checkpoint inside the timed window, and prints one JSON line:
median tokens/s and MFU over the steps after the first --warmup (the first one compiles), peak
device memory, drop fractions. MFU = costs.flops_per_token(spec) * tokens/s /
spec.hardware.peak_flops (989e12 for an H200). With one device the 8 EP shards of the proxy are
emulated (the same pooled-wave code under vmap).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.jax.engine import JaxEngine  # noqa: E402
from experiments.proxy_h200 import HERO, RUNGS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rung", default="d512")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--dispatch", choices=["capacity", "dropless"], default=None)
    args = ap.parse_args()
    specs = {s.name: s for s in (*RUNGS, HERO)}
    spec = specs[args.rung]
    changes = {"engine": "jax", "data.total_tokens": spec.data.tokens_per_step * args.steps,
               "run.checkpoint_every": 10**6, "run.eval_every": 10**6}
    if args.dispatch:
        changes["model.dispatch"] = args.dispatch
    spec = spec.replace(**changes)
    import jax

    with tempfile.TemporaryDirectory() as run_dir:
        recs = list(JaxEngine().train(spec, run_dir, resume=False))
    timed = recs[args.warmup:]
    dev = jax.devices()[0]
    mem = dev.memory_stats() or {}
    out = {
        "rung": args.rung, "dispatch": spec.model.dispatch, "steps": len(recs),
        "tokens_per_step": spec.data.tokens_per_step,
        "tokens_per_s": float(np.median([r.tokens_per_s for r in timed])),
        "mfu": float(np.median([r.mfu for r in timed])),
        "first_step_s": recs[0].tokens / recs[0].tokens_per_s,
        "loss_first": recs[0].loss, "loss_last": recs[-1].loss,
        "drop_frac_send": float(np.mean([r.drop_frac_send for r in timed])),
        "drop_frac_recv": float(np.mean([r.drop_frac_recv for r in timed])),
        "peak_mem_gb": mem.get("peak_bytes_in_use", 0) / 1e9,
        "device": dev.device_kind, "jax": jax.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
