"""Is the ladder in its hero's regime? A check from the rungs' own curves and final losses.

On code text a model's train loss falls steeply for a while once it learns in-context copying: the
local slope s(T) = -dlnL/dlnT rises from its baseline (about 0.3) to a bump (0.5-0.7) and falls back.
A ladder whose rungs end before, or inside, that bump while the hero ends well past it forecasts the
hero from a different regime. `regime_check(rungs)` returns one RegimeWarning per finding (kind in
KINDS, a one-line message naming the runs and numbers); an empty list means no finding. Rules:

- ends_inside_transition / ends_before_transition: a run's slope has a bump it has not come back
  from by its end (a seed that lands mid-bump scatters the family's mean), or it has no bump while
  another rung's bump peaks beyond its end (it is fitted from before the regime change).
- final_slopes_steepen: -dlnL/dlnC between successive rung families (on one tokens-per-parameter
  line, or along the best-loss envelope of a grid) grows with compute beyond the noise; the law
  E + A C^-alpha with E >= 0 has slope alpha (1 - E/L), which can only flatten with compute.
- law_steeper_than_curve: the law's slope in tokens at the hero (law_slope, from the caller) is
  steeper than the largest rung's own late curve: the forecast extrapolates a fall no run shows.
- size_not_identified: every family sits at one tokens-per-active-parameter ratio, so size and
  tokens move together and the law cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from analysis.runs import replicates
from core import costs

KINDS = ("ends_before_transition", "ends_inside_transition", "final_slopes_steepen", "law_steeper_than_curve",
         "size_not_identified")

BINS_PER_DECADE = 10  # bins 26% wide in tokens: several per bump (which spans a factor ~3), each averaging many steps
SMOOTH = 1  # +-1 bin running mean on the slope: binned slopes scatter by ~0.02, the bump is ~0.25 high
MIN_STEPS = 30  # ignore the first 30 steps' tokens: warmup and the first fall of the unigram loss are no regime
BASE_WINDOW = (1 / 10, 1 / 2.5)  # baseline: median slope over the factor-4 in tokens before the bump's rise
BUMP_MARGIN = 0.1  # a bump rises >= 0.1 above its baseline: 4x the binned-slope noise, under half the copying bump
END_EXCESS = 0.5  # back from the bump once the excess has fallen to half its peak (past its falling half-maximum)
PAST_PEAK = 1.5  # ... and no sooner than 1.5x the peak's tokens: the bump's rise from half-maximum spans about that
MIN_LINE = 3  # slopes steepening needs two successive slopes, so three families
Z_STEEPEN = 2.0  # steepening beyond 2 standard errors of the measured noise (one-sided, ~2%)
LATE_WINDOW = (0.5, 0.8)  # a run's late slope: tokens from half its end to before the last 20%, where the LR anneal steepens it
LAW_MARGIN = 0.05  # law slope above the late slope by > 0.05: twice the late window's own binning scatter


@dataclass(frozen=True)
class RegimeWarning:
    kind: str
    message: str
    runs: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {**asdict(self), "runs": list(self.runs)}


@dataclass(frozen=True)
class Transition:
    peak_tokens: float
    peak_slope: float
    baseline: float
    ended_tokens: float | None  # where the slope has come back (None: not by the run's end)
    last_tokens: float  # the run's last tokens

    @property
    def excess(self) -> float:
        return self.peak_slope - self.baseline


def local_slope(tokens, loss, *, per_decade: int = BINS_PER_DECADE, min_tokens: float = 0.0
                ) -> tuple[np.ndarray, np.ndarray]:
    """(token grid, -dlnL/dlnT): ln loss averaged in log-token bins, differentiated, then smoothed."""
    t, y = np.asarray(tokens, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    ok = np.isfinite(t) & np.isfinite(y) & (t > max(min_tokens, 0.0)) & (y > 0)
    lt, ly = np.log10(t[ok]), np.log(y[ok])
    if lt.size < 2 or lt.max() <= lt.min():
        return np.empty(0), np.empty(0)
    n = max(int(np.ceil((lt.max() - lt.min()) * per_decade)), 1)
    idx = np.minimum(((lt - lt.min()) / (lt.max() - lt.min()) * n).astype(int), n - 1)
    cnt = np.bincount(idx, minlength=n)
    keep = cnt > 0
    x = np.bincount(idx, lt, n)[keep] / cnt[keep]
    m = np.bincount(idx, ly, n)[keep] / cnt[keep]
    if x.size < 3:
        return 10 ** x, np.full(x.size, np.nan)
    s = -np.gradient(m, x * np.log(10))
    k = 2 * SMOOTH + 1
    s = np.convolve(np.pad(s, SMOOTH, mode="edge"), np.ones(k) / k, mode="valid")
    return 10 ** x, s


def _curve(run) -> tuple[np.ndarray, np.ndarray]:
    m = run.metrics
    return local_slope(m["tokens"], m["loss"], min_tokens=MIN_STEPS * run.spec.data.tokens_per_step)


def find_transition(tokens, loss, *, min_tokens: float = 0.0) -> Transition | None:
    """The bump in the local slope (None: no peak BUMP_MARGIN above its baseline)."""
    t, s = local_slope(tokens, loss, min_tokens=min_tokens)
    if t.size < 5 or not np.isfinite(s).all():
        return None
    i = int(np.argmax(s))
    peak_t = t[i]
    if 0 < i < t.size - 1:  # the vertex of the parabola through the peak and its neighbours, in log tokens
        x, y = np.log(t[i - 1:i + 2]), s[i - 1:i + 2]
        a, b, _ = np.polyfit(x, y, 2)
        if a < 0:
            peak_t = float(np.exp(np.clip(-b / (2 * a), x[0], x[2])))
    base = (t >= peak_t * BASE_WINDOW[0]) & (t <= peak_t * BASE_WINDOW[1])
    if not base.any():
        return None
    baseline = float(np.median(s[base]))
    if s[i] - baseline < BUMP_MARGIN:
        return None
    back = (t >= PAST_PEAK * peak_t) & (s - baseline <= END_EXCESS * (s[i] - baseline))
    ended = float(t[np.argmax(back)]) if back.any() else None
    return Transition(float(peak_t), float(s[i]), baseline, ended, float(np.nanmax(np.asarray(tokens, float))))


def _tr(run) -> Transition | None:
    return find_transition(run.metrics["tokens"], run.metrics["loss"],
                           min_tokens=MIN_STEPS * run.spec.data.tokens_per_step)


def _m(t: float) -> str:
    return f"{t / 1e6:.3g}M"


def _transition_warnings(rungs) -> list[RegimeWarning]:
    trs = {r.spec.name: _tr(r) for r in rungs}
    ends = {r.spec.name: float(costs.tokens(r.spec)) for r in rungs}
    inside = [(n, tr) for n, tr in trs.items() if tr is not None and tr.ended_tokens is None]
    peaks = [(n, tr.peak_tokens) for n, tr in trs.items() if tr is not None]
    before = [(n, [p for p in peaks if p[1] > ends[n]]) for n, tr in trs.items() if tr is None]
    before = [(n, later) for n, later in before if later]
    out = []
    if inside:
        what = "; ".join(f"{n} ends at {_m(ends[n])} tokens with slope peaking {tr.peak_slope:.2f} at {_m(tr.peak_tokens)} "
                         f"(baseline {tr.baseline:.2f}), not back by its end" for n, tr in inside)
        out.append(RegimeWarning("ends_inside_transition", f"rungs end inside the loss-slope transition: {what}",
                                 tuple(n for n, _ in inside)))
    if before:
        what = "; ".join(f"{n} ends at {_m(ends[n])} tokens, before the transition that "
                         f"{', '.join(f'{p} shows at {_m(t)}' for p, t in later[:2])}" for n, later in before)
        out.append(RegimeWarning("ends_before_transition", f"rungs end before the loss-slope transition: {what}",
                                 tuple(n for n, _ in before)))
    return out


def _steepening(fams, nz) -> list[RegimeWarning]:
    tpp = {f.name: costs.tokens_per_active_param(f.spec) for f in fams}
    C = {f.name: costs.total_flops(f.spec) for f in fams}
    lines: list[list] = []
    for f in sorted(fams, key=lambda f: tpp[f.name]):
        if lines and costs.same_budget(tpp[f.name], tpp[lines[-1][0].name]):
            lines[-1].append(f)
        else:
            lines.append([f])
    groups = [(f"at {tpp[ln[0].name]:.3g} tokens per active parameter", ln) for ln in lines if len(ln) >= MIN_LINE]
    if len(lines) > 1:
        env, best = [], np.inf
        for f in sorted(fams, key=lambda f: C[f.name]):
            if f.final_loss < best:
                env.append(f)
                best = f.final_loss
        if len(env) >= MIN_LINE:
            groups.append(("along the best-loss envelope", env))
    out = []
    for where, g in groups:
        g = sorted(g, key=lambda f: C[f.name])
        x = np.log([C[f.name] for f in g])
        y = np.log([f.final_loss for f in g])
        v = np.array([nz.family_var[f.name] for f in g])
        for i in range(len(g) - 2):
            a, b = x[i + 1] - x[i], x[i + 2] - x[i + 1]
            s1, s2 = (y[i] - y[i + 1]) / a, (y[i + 1] - y[i + 2]) / b
            sd = np.sqrt(v[i] / a ** 2 + v[i + 1] * (1 / a + 1 / b) ** 2 + v[i + 2] / b ** 2)
            if s2 - s1 > Z_STEEPEN * sd:
                names = tuple(f.name for f in g[i:i + 3])
                out.append(RegimeWarning(
                    "final_slopes_steepen",
                    f"final-loss slopes -dlnL/dlnC steepen with compute {where}: {s1:.3f} ({names[0]}->{names[1]}) "
                    f"to {s2:.3f} ({names[1]}->{names[2]}), {(s2 - s1) / sd:.1f} standard errors; "
                    f"no E >= 0 in E + A C^-alpha fits this", names))
    return out


def late_slope(run) -> float:
    """The run's median local slope over LATE_WINDOW of its tokens (after any bump, before the anneal's end)."""
    t, s = _curve(run)
    end = float(costs.tokens(run.spec))
    w = (t >= LATE_WINDOW[0] * end) & (t <= LATE_WINDOW[1] * end)
    return float(np.median(s[w])) if w.any() else float("nan")


def regime_check(rungs: Sequence, *, law_slope: float | None = None, law_label: str = "") -> list[RegimeWarning]:
    """The regime warnings for a ladder's finished rungs (RungRun), in KINDS order."""
    if not rungs:
        return []
    fams = replicates.group(rungs)
    out = _transition_warnings(rungs)
    out += _steepening(fams, replicates.noise(fams))
    if law_slope is not None:
        big = max(fams, key=lambda f: costs.total_flops(f.spec))
        late = float(np.nanmean([late_slope(r) for r in big.runs]))
        if law_slope > late + LAW_MARGIN:
            label = f" ({law_label})" if law_label else ""
            out.append(RegimeWarning(
                "law_steeper_than_curve",
                f"the law's slope -dlnL/dlnT at the hero{label}, {law_slope:.3f}, is steeper than the largest rung "
                f"{big.name}'s own late-curve slope {late:.3f} by more than {LAW_MARGIN}", tuple(big.names)))
    tpps = [costs.tokens_per_active_param(f.spec) for f in fams]
    if len(fams) > 1 and costs.same_budget(max(tpps), min(tpps)):
        out.append(RegimeWarning(
            "size_not_identified",
            f"all {len(fams)} rung families sit at {np.median(tpps):.3g} tokens per active parameter: size and "
            f"tokens grow together, so the law cannot tell a size effect from a data effect",
            tuple(f.name for f in fams)))
    return sorted(out, key=lambda w: KINDS.index(w.kind))
