"""Write a W&B run with the real `wandb` library in offline mode, as OLMo-core's W&B callback would
(its metric names, steps from 1): a falling loss with a planted spike and a grad-norm blow-up.

    python -m tests.analysis.wandb_writer DIR --steps 200 --spike 120 --blowup 160 [--delay 0.02] [--fail] [--spec S]

Prints the run directory as its first line. With --delay it sleeps between steps; with --pause-at N
--go-file F it stops after step N until F exists (a run half written while a reader follows it);
with --fail it exits the run with code 1.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--spike", type=int, default=None)
    ap.add_argument("--blowup", type=int, default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--fail", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spec", default=None, help="log this spec's LR schedule and tokens per step")
    ap.add_argument("--config-json", default=None, help="the run's config (as OLMo-core's W&B callback passes it)")
    ap.add_argument("--pause-at", type=int, default=None, help="after this step, wait for --go-file to exist")
    ap.add_argument("--go-file", default=None)
    a = ap.parse_args()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true",
                      WANDB_DISABLE_CODE="true", WANDB_CONSOLE="off")
    import wandb

    rng = np.random.default_rng(a.seed)
    spec = None
    if a.spec:
        from core.schedule import lr_at
        from core.spec import load_spec

        spec = load_spec(a.spec)
    import json

    config = json.load(open(a.config_json)) if a.config_json else \
        {"model": {"d_model": 256}, "train_module": {"optim": {"lr": 1e-3}}}
    run = wandb.init(project="olmo-core-ladder", dir=a.dir, mode="offline", config=config,
                     settings=wandb.Settings(x_disable_stats=True, x_disable_meta=True))
    print(run.dir.rsplit("/files", 1)[0], flush=True)
    tokens = 0
    for step in range(1, a.steps + 1):  # OLMo-core counts steps from 1 (trainer.py:1479)
        tokens += spec.data.tokens_per_step if spec else 8 * 64
        lr = float(lr_at(spec, step - 1)) if spec else 1e-3  # OLMo-core's step s is this project's s - 1
        loss = 2.0 + 3.0 * step ** -0.3 + 0.005 * rng.standard_normal()
        if a.spike is not None and step == a.spike:
            loss += 1.5
        grad = 0.6 + 0.02 * rng.standard_normal()
        if a.blowup is not None and step >= a.blowup:
            grad = 0.6 * math.exp(0.15 * (step - a.blowup + 1))
        run.log({"train/CE loss": loss, "optim/total grad norm": grad, "optim/LR (group 0)": lr,
                 "throughput/total tokens": tokens, "train/Z loss": 1e-4}, step=step)
        if a.delay:
            time.sleep(a.delay)
        if a.pause_at == step and a.go_file:
            t0 = time.monotonic()
            while not os.path.exists(a.go_file) and time.monotonic() - t0 < 300:  # 300 s: only a hang guard
                time.sleep(0.1)
    run.finish(exit_code=1 if a.fail else 0)


if __name__ == "__main__":
    main()
