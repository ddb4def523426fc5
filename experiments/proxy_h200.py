"""Marin's ladder scaled to one H200: four rungs and a hero proxy, all trained in about 12
GPU-minutes, so the whole experiment repeats in one short GPU window (`make h200-ladder`).

Shape rules: experiments/marin_535b.py's (core.rules.moe_model): 64 routed experts top-8 of
width d/2 inside a latent of d/2, 2 shared experts, head dim 64 with KV heads = heads / 4, a
512-token sliding window in 1,024-token sequences, z-loss 1e-4, 1% warmup then linear decay to
5% of peak, the same tokens per active parameter for every run. Why each number:
- Sizes. d192/3 layers, d256/4, d320/5, d384/7 and the hero d512/9. Training compute (FLOPs per
  token with attention and the output head, times tokens) spans 38x across the rungs, and the
  hero has 4.6x the largest rung's. Depth grows with width as in Marin's ladder.
- Tokens. 6 tokens per active parameter: the hero reads 179M tokens, under one epoch of the
  offline package corpus (about 220M tokens in this tokenizer; `ladder plan` shows the epochs from
  the shards or the committed manifest), and trains in about 6.5 minutes at the 480k tokens/s the
  torch engine reaches at this size (12% MFU, as measured on these shapes with byte tokens),
  under the 10-minute limit per run. Fewer tokens per parameter than Marin's 791: the corpus and
  the GPU window bound it; the ladder only needs the ratio to be the same for every run.
- Dispatch dropless: on one GPU the expert shards are emulated, and the pooled-wave transport
  there costs about 17% of throughput without changing what the ladder measures.
- Batch: the hero's is 64 x 1,024 tokens; a rung's is that scaled by the square root of its
  compute over the hero's (core.rules.scaled_batch: 8, 8, 16 and 32 sequences), so every run
  takes 1,000-2,700 optimiser steps. Code text has a steep fall in loss once a model learns to copy
  from its context; with one batch for all, the small rungs stopped after 130-600 steps, before
  that fall, and the law fitted to them missed the largest rung by 35%.
- Eval: every run scores the same fixed eval set (engines/evalset.py: 1M tokens of Python, 1M
  of C/C++, 1% of the prose, held out by document across each source). Periodic evals, every
  100 steps or 1/20 of the run, whichever is longer, score its first 64 windows of each source;
  the final eval scores every window, and that is what the laws fit.
- Replicates: every rung again at seed 1, and the hero at seeds 1-3, measure the ladder's own
  noise (the forecast's measurement term; the monitor's band and its healthy replicates).
- Peak LR 0.04 / sqrt(d) (2.9e-3 at d192, 1.8e-3 at d512), as the byte-level ladder used.
- Checkpoints every 1,000 steps (a resumed run loses
  at most a minute; each checkpoint of the hero is about 1.5 GB).
Text: the offline corpus `make corpus` builds from the machine's installed packages
(engines.corpus: Python, C/C++/CUDA and prose, deduplicated) in the 16,384-id byte-level BPE
experiments/tokenizers/h200-16k.json, trained by
    ladder data tokenizer --corpus CORPUS/python/shard-00000.jsonl --corpus CORPUS/python/shard-00001.jsonl \
        --corpus CORPUS/docs/shard-00000.jsonl --corpus CORPUS/native/shard-00000.jsonl \
        --vocab-size 16384 --out experiments/tokenizers/h200-16k.json
The sources are mixed in proportion to their sizes, so every source runs out at the same rate.
"""

from ladder.experiment import Experiment, replicate
from core.costs import param_counts, total_flops
from core.rules import moe_model, run_spec, scaled_batch
from engines.tokenizer import padded_vocab

SEQ, BATCH = 1024, 64
TOKENS_PER_ACTIVE = 6
TOKENIZER = "h200-16k"
VOCAB = padded_vocab(TOKENIZER)  # a multiple of 128
SOURCES = [{"name": "python", "builtin": "packages_python", "weight": 0.53},
           {"name": "native", "builtin": "packages_native", "weight": 0.45},
           {"name": "docs", "builtin": "packages_docs", "weight": 0.02}]
H200 = {"system": "h200", "n_gpus": 1, "ep_domain": 1, "peak_flops": 989e12, "hbm_gb": 141,
        "expected_mfu": 0.12, "task_cpus": 4, "task_gpus": 1}


def _model(d: int, layers: int):
    return moe_model(d, layers, head_dim=64, vocab_size=VOCAB, n_routed_experts=64, top_k=8, ep_size=8,
                     window=512, capacity_factor=1.15, n_waves=3, dispatch="dropless")


def proxy(d: int, layers: int, role: str = "rung", batch: int = BATCH):
    model = _model(d, layers)
    steps = round(TOKENS_PER_ACTIVE * param_counts(model)["active"] / (SEQ * batch))
    every = 100 if batch == BATCH else max(100, steps // 20)
    return run_spec(f"{'hero-' if role == 'hero' else ''}d{d}", model, batch_size=batch, steps=steps, seq_len=SEQ,
                    sources=SOURCES, tokenizer=TOKENIZER, peak_lr=0.04 / d**0.5, role=role, hardware=H200,
                    run={"checkpoint_every": 1000, "eval_every": every, "eval_batches": 8})


HERO = proxy(512, 9, role="hero")


def rung(d: int, layers: int):
    """A rung at the hero's tokens per active parameter, its batch scaled down with its compute."""
    return proxy(d, layers, batch=scaled_batch(total_flops(proxy(d, layers)), total_flops(HERO), BATCH))


BASE_RUNGS = (rung(192, 3), rung(256, 4), rung(320, 5), rung(384, 7))
RUNGS = BASE_RUNGS + tuple(replicate(r, 1) for r in BASE_RUNGS)

EXPERIMENT = Experiment(name="proxy_h200", rungs=RUNGS, hero=HERO, extras=tuple(replicate(HERO, s) for s in (1, 2, 3)))
