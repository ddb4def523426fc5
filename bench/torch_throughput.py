"""Tokens/s and MFU of the PyTorch engine on a spec of experiments/proxy_h200.py (bf16 on a GPU).

    python bench/torch_throughput.py --rung d512 --steps 40 [--dispatch capacity|dropless]

Trains the rung for --steps steps (its schedule re-timed to that many steps; throughput does not
depend on the LR), with no eval or checkpoint inside the timed window, and prints one JSON line:
median tokens/s and MFU over the steps after the first --warmup, peak GPU memory, drop fractions.
MFU = costs.flops_per_token(spec) * tokens/s / spec.hardware.peak_flops (989e12 for an H200).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.torch.engine import TorchEngine  # noqa: E402
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
    changes = {"data.total_tokens": spec.data.tokens_per_step * args.steps,
               "run.checkpoint_every": 10**6, "run.eval_every": 10**6}
    if args.dispatch:
        changes["model.dispatch"] = args.dispatch
    spec = spec.replace(**changes)
    import torch

    with tempfile.TemporaryDirectory() as run_dir:
        recs = list(TorchEngine().train(spec, run_dir, resume=False))
    timed = recs[args.warmup:]
    out = {
        "rung": args.rung, "dispatch": spec.model.dispatch, "steps": len(recs),
        "tokens_per_step": spec.data.tokens_per_step,
        "tokens_per_s": float(np.median([r.tokens_per_s for r in timed])),
        "mfu": float(np.median([r.mfu for r in timed])),
        "loss_first": recs[0].loss, "loss_last": recs[-1].loss,
        "drop_frac_send": float(np.mean([r.drop_frac_send for r in timed])),
        "drop_frac_recv": float(np.mean([r.drop_frac_recv for r in timed])),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
