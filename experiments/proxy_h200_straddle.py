"""The first H200 ladder (trained at main a6e1175, kept in docs/results/h200_ladder/h200_ladder.tar.gz):
four rungs on the hero's line of 6 tokens per active parameter, their batches scaled down with
their compute (8-32 sequences against the hero's 64). Its forecast missed the hero by 8-9% while
its backtest reassured: the rungs straddle the loss curves' in-context-copying transition (d192
ends before it, d256 inside it), one tokens-per-parameter line leaves size unidentified, and the
rungs train at other batches than the hero. It stays as the regime check's test case
(analysis.forecast.regime); experiments/proxy_h200.py is the ladder that replaced it.

Everything but the rungs (shapes, data, eval, LR rule, the hero) is experiments/proxy_h200.py's.
"""

from ladder.experiment import Experiment, replicate
from core.costs import total_flops
from core.rules import scaled_batch
from experiments.proxy_h200 import BATCH, HERO, proxy


def rung(d: int, layers: int):
    """A rung at the hero's tokens per active parameter, its batch scaled down with its compute."""
    return proxy(d, layers, batch=scaled_batch(total_flops(proxy(d, layers)), total_flops(HERO), BATCH))


BASE_RUNGS = (rung(192, 3), rung(256, 4), rung(320, 5), rung(384, 7))
RUNGS = BASE_RUNGS + tuple(replicate(r, 1) for r in BASE_RUNGS)

EXPERIMENT = Experiment(name="proxy_h200", rungs=RUNGS, hero=HERO, extras=tuple(replicate(HERO, s) for s in (1, 2, 3)))
