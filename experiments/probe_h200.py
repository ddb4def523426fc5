"""Batch and learning-rate probes beside the H200 ladder (experiments/proxy_h200.py): its two
smallest rungs at the batch and peak LR other rules would give, at the same tokens, to show how
much the rung losses the ladder's law is fitted to depend on the batch rule.

- d192 at 16 sequences: the batch DeepSeek LLM's compute-optimal fit (exponent 0.33) would give;
- d192 at 8 sequences with half the peak LR: the square-root LR-batch rule's direction;
- d256 at 32 sequences: between the ladder's 8 and the 64 of a single batch for all runs.
The rungs of a single batch for all (64 sequences) ran before and are kept in
docs/results/h200_ladder/batch64_rungs.tar.gz.
"""

from ladder.experiment import Experiment
from experiments.proxy_h200 import proxy


def probe(d: int, layers: int, batch: int, lr_scale: float = 1.0):
    spec = proxy(d, layers, batch=batch)
    name = f"d{d}-b{batch}" + ("" if lr_scale == 1.0 else f"-lr{lr_scale:g}")
    return spec.replace(**{"name": name, "optim.peak_lr": spec.optim.peak_lr * lr_scale})


PROBES = (probe(192, 3, 16), probe(192, 3, 8, lr_scale=0.5), probe(256, 4, 32))

EXPERIMENT = Experiment(name="probe_h200", rungs=PROBES)
