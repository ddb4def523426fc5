"""Marin's ladder scaled to one H200, designed in the hero's regime: three sizes, each at several
token budgets, every run at the hero's batch and LR rule, and the hero (d512, 9 layers, 178.7M
tokens) an interpolation of the fit L(N, D) = E + A/N^a + B/D^b, not an extrapolation along one line.

Shape rules: experiments/marin_535b.py's (core.rules.moe_model): 64 routed experts top-8 of
width d/2 inside a latent of d/2, 2 shared experts, head dim 64 with KV heads = heads / 4, a
512-token sliding window in 1,024-token sequences, z-loss 1e-4, 1% warmup then linear decay to
5% of peak (every budget its own run, annealed at its end). Why each number:
- The regime. Code text has a steep fall in loss once a model learns to copy from its context
  (the local slope -dlnL/dlnT jumps from about 0.3 to 0.5-0.7). At 64 sequences per batch it
  peaks near 25-30M tokens for the hero and near 37M for d384, later for smaller models; the
  first ladder (experiments/proxy_h200_straddle.py) had rungs that ended before or inside it and
  missed the hero by 8-9%. Every run here ends at 77M tokens or more, twice past the slope's peak.
- Sizes. d384/7 layers (12.9M active), d448/8 (20.0M) and the hero's own shape d512/9 (29.8M):
  sizes near the hero, since at these scales a smaller model's curve is in an earlier regime.
- Budgets. Multiples of the hero's 6 tokens per active parameter (TOKENS_PER_ACTIVE), as AI2's
  OLMo ladder trains each size at several multiples of its rule: d384 at 1x, 1.5x and 2x, d448 at
  0.75x and 1.5x (180M tokens, the hero's), d512 at 0.5x and 0.75x. Tokens then vary at fixed
  size and size at fixed tokens, so the fit identifies both terms; the hero sits between d448 at
  its tokens and its own shape at 3/4 of them. The largest run reads 180M tokens, under one epoch of
  the offline package corpus (about 208M training tokens in this tokenizer; `ladder plan` shows
  the epochs from the shards or the committed manifest).
- Batch: 64 x 1,024 tokens for every run, the hero's (probes on the first ladder showed +13-30%
  loss at equal tokens between batch 8 and 64); peak LR 0.04 / sqrt(d) (1.8e-3 at d512).
- GPU time: the rungs take about 16 GPU-minutes one after another (d384 1.27M, d448 about 1.05M,
  d512 0.90M tokens/s on one H200, plus about 30 s of start-up and final eval each).
- Dispatch dropless: on one GPU the expert shards are emulated, and the pooled-wave transport
  there costs about 17% of throughput without changing what the ladder measures.
- Eval: every run scores the same fixed eval set (engines/evalset.py: 1M tokens of Python, 1M
  of C/C++, 1% of the prose, held out by document across each source). Periodic evals, every
  100 steps, score a stratified sample of 64 windows of each source (one per 64th of its windows
  in position, engines.evalset.periodic_windows) with the final's weights; the final eval scores
  every window, and that is what the laws fit.
- Replicates: d384 at 1x again at seed 1 measures the ladder's seed noise (the forecast's
  measurement term); the hero at seeds 1-3 (extras) are the monitor's healthy replicates.
- Checkpoints every 500 steps (a resumed run loses under a minute; each of the hero's is about 1.5 GB).
Text: the offline corpus `make corpus` builds from the machine's installed packages
(engines.corpus: Python, C/C++/CUDA and prose, deduplicated) in the 16,384-id byte-level BPE
experiments/tokenizers/h200-16k.json, trained by
    ladder data tokenizer --corpus CORPUS/python/shard-00000.jsonl --corpus CORPUS/python/shard-00001.jsonl \
        --corpus CORPUS/docs/shard-00000.jsonl --corpus CORPUS/native/shard-00000.jsonl \
        --vocab-size 16384 --out experiments/tokenizers/h200-16k.json
The sources are mixed in proportion to their sizes, so every source runs out at the same rate.
"""

from ladder.experiment import Experiment, replicate
from core.costs import param_counts
from core.rules import moe_model, run_spec
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


def proxy(d: int, layers: int, role: str = "rung", batch: int = BATCH, multiple: float = 1.0, name: str | None = None,
          checkpoint_every: int = 1000):
    """d_model d with `layers` blocks reading `multiple` x TOKENS_PER_ACTIVE tokens per active parameter."""
    model = _model(d, layers)
    steps = round(multiple * TOKENS_PER_ACTIVE * param_counts(model)["active"] / (SEQ * batch))
    every = 100 if batch == BATCH else max(100, steps // 20)
    name = name or f"{'hero-' if role == 'hero' else ''}d{d}"
    return run_spec(name, model, batch_size=batch, steps=steps, seq_len=SEQ,
                    sources=SOURCES, tokenizer=TOKENIZER, peak_lr=0.04 / d**0.5, role=role, hardware=H200,
                    run={"checkpoint_every": checkpoint_every, "eval_every": every, "eval_batches": 8})


HERO = proxy(512, 9, role="hero")

# size -> the multiples of TOKENS_PER_ACTIVE it trains at
DESIGN = {(384, 7): (1.0, 1.5, 2.0), (448, 8): (0.75, 1.5), (512, 9): (0.5, 0.75)}


def budget_rung(d: int, layers: int, multiple: float):
    """A rung named d<d>-t<tokens per active parameter>, at the hero's batch and LR rule."""
    return proxy(d, layers, multiple=multiple, name=f"d{d}-t{multiple * TOKENS_PER_ACTIVE:g}", checkpoint_every=500)


BASE_RUNGS = tuple(budget_rung(d, layers, m) for (d, layers), ms in DESIGN.items() for m in ms)
RUNGS = BASE_RUNGS + (replicate(budget_rung(384, 7, 1.0), 1),)

EXPERIMENT = Experiment(name="proxy_h200", rungs=RUNGS, hero=HERO, extras=tuple(replicate(HERO, s) for s in (1, 2, 3, 4, 5)))
