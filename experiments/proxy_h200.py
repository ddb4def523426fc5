"""Marin's ladder scaled to one H200: four rungs (the largest ~115M total params) and a hero
proxy, planned to fit in about 20 GPU-minutes at the 12% MFU the torch engine measured on these
shapes (bf16, capacity mode).

Same rules as experiments/marin_535b.py (core.rules.moe_model) with 64 routed experts top-8
inside a latent of d/2, 2 shared experts, head dim 64, capacity factors 1.15 over 3 waves on 8
emulated EP shards, a 512-token sliding window in 1,024-token sequences, z-loss 1e-4, 1% warmup
then linear decay to 5% of peak. Text: the offline corpus `make corpus` builds from the H200
machine's installed packages (engines.corpus: 408 MB of Python, 303 MB of C/C++/CUDA, 13 MB of
prose) in the 16,384-id byte-level BPE experiments/tokenizers/h200-16k.json, trained by
    ladder data tokenizer --corpus CORPUS/python/shard-00000.jsonl --corpus CORPUS/python/shard-00001.jsonl \
        --corpus CORPUS/docs/shard-00000.jsonl --corpus CORPUS/native/shard-00000.jsonl \
        --vocab-size 16384 --out experiments/tokenizers/h200-16k.json
on the development machine's own corpus. The corpus holds 219M tokens under it (116M Python, 98M
native, 4.8M prose: experiments/corpus/h200.json, measured where it was built), mixed in
proportion to their sizes so every source runs out at the same rate. That bounds the budget:
3.2 tokens per active parameter puts the hero at 0.91 epochs, so no run reads a window twice.
"""

from core.costs import param_counts
from ladder.experiment import Experiment
from core.rules import moe_model, run_spec
from engines.tokenizer import padded_vocab

SEQ, BATCH = 1024, 64
TOKENS_PER_ACTIVE = 3.2
TOKENIZER = "h200-16k"
VOCAB = padded_vocab(TOKENIZER)  # a multiple of 128
SOURCES = [{"name": "python", "builtin": "packages_python", "weight": 0.53},
           {"name": "native", "builtin": "packages_native", "weight": 0.45},
           {"name": "docs", "builtin": "packages_docs", "weight": 0.02}]
H200 = {"system": "h200", "n_gpus": 1, "ep_domain": 1, "peak_flops": 989e12, "hbm_gb": 141,
        "expected_mfu": 0.12, "task_cpus": 4, "task_gpus": 1}


def proxy(d: int, layers: int, role: str = "rung"):
    model = moe_model(d, layers, head_dim=64, vocab_size=VOCAB, n_routed_experts=64, top_k=8, ep_size=8,
                      window=512, capacity_factor=1.15, n_waves=3)
    steps = round(TOKENS_PER_ACTIVE * param_counts(model)["active"] / (SEQ * BATCH))
    return run_spec(f"{'hero-' if role == 'hero' else ''}d{d}", model, batch_size=BATCH, steps=steps, seq_len=SEQ,
                    sources=SOURCES, tokenizer=TOKENIZER, peak_lr=0.04 / d**0.5, role=role, hardware=H200,
                    run={"checkpoint_every": 200, "eval_every": 100, "eval_batches": 8})


RUNGS = (proxy(256, 4), proxy(320, 6), proxy(384, 8), proxy(512, 8))
HERO = proxy(640, 12, role="hero")

EXPERIMENT = Experiment(name="proxy_h200", rungs=RUNGS, hero=HERO)
