"""Marin's public 535B-A23B MoE: the four-rung ladder (~1% of hero compute) and the hero.

Every model follows one shape rule (core.rules.moe_model): head dim 128, KV = heads / 4,
384 routed experts top-8 inside a latent of d/2, 2 shared experts, vocab 128,256 untied,
4,096 context with a 2,048 sliding window, capacity factors 1.15 / 1.15 over 3 waves, EP 64.
Batches are 1,024 sequences per GB200 NVL72 rack. For planning (`ladder plan`): the data paths
name the user's own token store.
"""

from ladder.experiment import Experiment
from core.rules import moe_model, run_spec

SEQ = 4096
SOURCES = [
    {"name": "pretrain", "paths": ["data/pretrain/*.parquet"], "weight": 1.0},
    {"name": "midtrain", "paths": ["data/midtrain/*.parquet"], "weight": 0.0},
]


def gb200(racks: int) -> dict:
    return {"system": "gb200-nvl72", "n_gpus": 72 * racks, "ep_domain": 64, "peak_flops": 2.5e15,
            "hbm_gb": 186, "expected_mfu": 0.35, "task_gpus": 72 * racks}


def rung(d: int, layers: int, racks: int, steps: int, lr: float):
    return run_spec(f"d{d}", moe_model(d, layers), batch_size=1024 * racks, steps=steps, seq_len=SEQ,
                    sources=SOURCES, peak_lr=lr, tokenizer="llama3", hardware=gb200(racks))


RUNGS = (
    rung(768, 8, racks=1, steps=11_420, lr=4e-3),
    rung(1024, 12, racks=2, steps=15_276, lr=3e-3),
    rung(1536, 16, racks=6, steps=15_128, lr=2.5e-3),
    rung(2048, 22, racks=11, steps=20_072, lr=2e-3),
)

HERO = run_spec(
    "d6144", moe_model(6144, 48), role="hero", batch_size=1024 * 11, steps=390_251, seq_len=SEQ,
    sources=SOURCES, peak_lr=1.2e-3, tokenizer="llama3", hardware=gb200(11),
    # 80% pretrain, 20% midtrain; longer contexts only if token drops allow (gated stages)
    data={"phases": [{"name": "midtrain", "start_frac": 0.8, "weights": {"pretrain": 0.3, "midtrain": 0.7}}],
          "context_stages": [{"start_frac": 0.5, "seq_len": 8192}, {"start_frac": 0.95, "seq_len": 65536},
                             {"start_frac": 0.99, "seq_len": 262144}]},
    # an early 1-2 day cooldown branch, 10-20 days in
    schedule={"cooldown_branches": [{"name": "early-cooldown", "start_frac": 0.3, "length_frac": 0.04}]},
)

EXPERIMENT = Experiment(name="marin_535b", rungs=RUNGS, hero=HERO)
