"""Marin's ladder scaled down to a 2-core CPU: three sizes at two token budgets each and a hero proxy
on real text, designed as the H200 ladder is (experiments/proxy_h200.py): every run at the hero's batch
and LR rule, each size at two multiples of the hero's 20 tokens per active parameter, so the forecast
fits L(N, D) over the grid rather than L(C) along one line.

Same rules as experiments/marin_535b.py (core.rules.moe_model): routed experts top-k inside a
latent of d/2 with 2 shared experts, capacity factors 1.15 over 3 waves on emulated EP shards,
sliding-window attention, z-loss 1e-4, 1% warmup then linear decay to 5% of peak, a fixed
tokens-per-active-parameter budget, peak LR falling as 1/sqrt(width). Text: the Python
installation's own source code and prose, mixed 95/5 (the prose is small: at this mix the hero
proxy reads each source less than once), in the 4,096-id byte-level BPE experiments/tokenizers/
cpu-4k.json, trained by
    ladder data tokenizer --corpus CORPUS/python/shard-00000.jsonl --corpus CORPUS/docs/shard-00000.jsonl \
        --vocab-size 4096 --out experiments/tokenizers/cpu-4k.json
on a corpus built by `ladder data corpus --out CORPUS` on the 2-core development machine. Sizes d24/2,
d40/2 and d48/3 (10K, 27K and 59K active parameters) at 1x and 2x, 0.5x and 1x, 0.5x and 1x of the
rule: the rungs span 14x in compute, 61% of the hero's together, and the hero proxy (d64/4, 135K
active) is 3.6x the largest rung. The hero at seeds 1 and 2 (extras) are the monitor's healthy
replicates: `ladder calibrate` makes the calibration `ladder compare` judges the hero by.
"""

from core.costs import param_counts
from ladder.experiment import Experiment, replicate
from core.rules import moe_model, run_spec

SEQ, BATCH = 128, 8
TOKENS_PER_ACTIVE = 20
TOKENIZER = "cpu-4k"
SOURCES = [{"name": "code", "builtin": "python_code", "weight": 0.95},
           {"name": "docs", "builtin": "python_docs", "weight": 0.05}]


def proxy(d: int, layers: int, role: str = "rung", cpus: int = 1, multiple: float = 1.0):
    """d_model d with `layers` blocks reading `multiple` x TOKENS_PER_ACTIVE tokens per active parameter."""
    model = moe_model(d, layers, head_dim=16, vocab_size=4096, n_routed_experts=16, top_k=2,
                      ep_size=4, window=64, capacity_factor=1.15, n_waves=3)
    steps = max(50, round(multiple * TOKENS_PER_ACTIVE * param_counts(model)["active"] / (SEQ * BATCH)))
    hardware = {"system": "cpu", "peak_flops": 5e10, "expected_mfu": 0.15, "task_cpus": cpus}
    name = f"hero-d{d}" if role == "hero" else f"d{d}-t{multiple * TOKENS_PER_ACTIVE:g}"
    return run_spec(name, model, batch_size=BATCH, steps=steps, seq_len=SEQ,
                    sources=SOURCES, tokenizer=TOKENIZER, peak_lr=0.02 / d**0.5, role=role, hardware=hardware,
                    run={"checkpoint_every": 100, "eval_every": 50, "eval_batches": 4},
                    # the fixed eval set: 131K tokens of each source (the prose: at most 4% of it), held out by
                    # document; periodic evals score 32 windows a source, the final eval all of them
                    data={"eval_fraction": 0.04, "eval_tokens": 2**17})


# size -> the multiples of TOKENS_PER_ACTIVE it trains at
DESIGN = {(24, 2): (1.0, 2.0), (40, 2): (0.5, 1.0), (48, 3): (0.5, 1.0)}
RUNGS = tuple(proxy(d, layers, multiple=m) for (d, layers), ms in DESIGN.items() for m in ms)
HERO = proxy(64, 4, role="hero", cpus=2)

REPLICATES = tuple(replicate(HERO, seed) for seed in (1, 2))

EXPERIMENT = Experiment(name="proxy_cpu", rungs=RUNGS, hero=HERO, extras=REPLICATES)
