"""Marin's ladder scaled down to a 2-core CPU: four rungs and a hero proxy on real text.

Same rules as experiments/marin_535b.py (ladder.rules.moe_model): routed experts top-k inside a
latent of d/2 with 2 shared experts, capacity factors 1.15 over 3 waves on emulated EP shards,
sliding-window attention, z-loss 1e-4, 1% warmup then linear decay to 5% of peak, a fixed
tokens-per-active-parameter budget. Byte-level tokens of the Python installation's own source
code and prose, mixed 70/30.
"""

from ladder.experiment import Experiment
from ladder.rules import moe_model, run_spec

SEQ, BATCH = 128, 16
TOKENS_PER_ACTIVE = 12
SOURCES = [{"name": "code", "builtin": "python_code", "weight": 0.7},
           {"name": "docs", "builtin": "python_docs", "weight": 0.3}]
CPU = {"system": "cpu-2core", "n_gpus": 0, "peak_flops": 5e10, "hbm_gb": 24, "expected_mfu": 0.1, "task_cpus": 1}


def proxy(name: str, d: int, layers: int, lr: float, role: str = "rung"):
    model = moe_model(d, layers, head_dim=16, vocab_size=256, n_routed_experts=16, top_k=2,
                      ep_size=4, window=64, capacity_factor=1.15, n_waves=3)
    from ladder.costs import param_counts

    steps = max(50, round(TOKENS_PER_ACTIVE * param_counts(model)["active"] / (SEQ * BATCH)))
    return run_spec(name, model, batch_size=BATCH, steps=steps, seq_len=SEQ, sources=SOURCES, peak_lr=lr,
                    role=role, hardware=CPU, run={"checkpoint_every": 50, "eval_every": 25, "eval_batches": 4})


RUNGS = (
    proxy("d32", 32, 2, lr=4e-3),
    proxy("d48", 48, 3, lr=3.5e-3),
    proxy("d64", 64, 4, lr=3e-3),
    proxy("d96", 96, 5, lr=2.5e-3),
)
HERO = proxy("hero-d160", 160, 6, lr=2e-3, role="hero")

EXPERIMENT = Experiment(name="proxy_cpu", rungs=RUNGS, hero=HERO)
