"""A self-contained HTML report of a ladder: plan, scaling-law fit with the hero forecast, rung
curves with the curve model, the hero against its band, grad norm against its envelope, drops and
router entropy, flags and replan options. Plots are PNG files beside index.html.

Inputs are plain files, so the report can be rebuilt at any time:
  runs       {name: DataFrame of metrics.jsonl} and {name: plan row}
  forecast   forecast.json (see analysis/forecast/hero.py)
  flags      list of monitor flags (kind, severity, first_step, evidence)
  replan     list of replan option rows
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.forecast.file import HeroForecast  # noqa: E402
from core.fsutil import atomic_write_text  # noqa: E402

COLORS = plt.get_cmap("viridis")


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _rung_color(i: int, n: int):
    return COLORS(0.1 + 0.75 * i / max(n - 1, 1))


def plot_law(out: Path, plan: list[dict], finals: dict[str, float], forecast: HeroForecast | None, hero_actual: float | None):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rungs = [r for r in plan if r["role"] == "rung" and r["name"] in finals]
    if rungs:
        ax.scatter([r["flops"] for r in rungs], [finals[r["name"]] for r in rungs], color="C0", zorder=3, label="rungs (final eval loss)")
        for r in rungs:
            ax.annotate(r["name"], (r["flops"], finals[r["name"]]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if forecast:
        law = forecast.law
        curve = law.curve if law else None
        if curve:
            label = (law.label or "fitted law") + (" at the hero's size" if law.kind == "size_tokens" else "")
            ax.plot(curve["flops"], curve["loss"], color="C0", alpha=0.6, label=label)
            if "lo" in curve:
                ax.fill_between(curve["flops"], curve["lo"], curve["hi"], color="C0", alpha=0.12)
        h = forecast.hero
        fl = h.final_loss
        if fl and h.flops:
            ax.errorbar([h.flops], [fl["mean"]], yerr=[[fl["mean"] - fl["lo"]], [fl["hi"] - fl["mean"]]], fmt="D",
                        color="C3", capsize=5, label=f"hero forecast ({int(100 * fl.get('level', 0.9))}% interval)")
            if hero_actual is not None:
                ax.scatter([h.flops], [hero_actual], marker="*", s=160, color="k", zorder=4, label="hero actual")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("final eval loss (nats/token)")
    ax.set_title("Scaling law over the ladder, and the hero forecast")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out, "law.png")


def plot_rungs(out: Path, runs: dict[str, pd.DataFrame], roles: dict[str, str], forecast: HeroForecast | None):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [n for n in runs if roles.get(n) == "rung"]
    fits = forecast.rung_fits if forecast else None
    for i, name in enumerate(names):
        df = runs[name]
        c = _rung_color(i, len(names))
        ax.plot(df["tokens"], df["loss"], color=c, alpha=0.35, lw=0.8)
        ev = df.dropna(subset=["eval_loss"]) if "eval_loss" in df else df.iloc[0:0]
        if len(ev):
            ax.scatter(ev["tokens"], ev["eval_loss"], color=c, s=10)
        fit = fits.get(name) if fits else None
        if fit:
            ax.plot(fit.tokens, fit.pred, color=c, lw=1.6, ls="--")
        ax.plot([], [], color=c, label=name)
    ax.plot([], [], color="gray", ls="--", label="curve model fit")
    ax.set_xscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_title("Rung loss curves (train, eval dots) and the curve model")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out, "rungs.png")


def plot_hero(out: Path, hero: pd.DataFrame | None, forecast: HeroForecast | None, flags: list[dict]):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    tr = forecast.trajectory if forecast else None
    if tr and tr.step:
        ax.fill_between(tr.step, tr.lo, tr.hi, color="C3", alpha=0.18, label="forecast band")
        ax.plot(tr.step, tr.loss, color="C3", lw=1.2, label="forecast")
    if hero is not None and len(hero):
        ax.plot(hero["step"], hero["loss"], color="0.6", lw=0.5, label="hero train loss (per step)")
        ax.plot(hero["step"], hero["loss"].rolling(25, min_periods=1, center=True).mean(), color="k", lw=1.2,
                label="hero train loss (mean of 25)")
        if "eval_loss" in hero and hero["eval_loss"].notna().any():
            ev = hero.dropna(subset=["eval_loss"])
            flag = next((c for c in ("extra.eval_final", "eval_final") if c in ev), None)
            final = (ev[flag].apply(lambda v: v is True or v == 1) if flag else pd.Series(False, index=ev.index)).to_numpy(bool)
            ax.scatter(ev["step"][~final], ev["eval_loss"][~final], color="C0", s=14, zorder=3,
                       label="hero eval loss (periodic sample)" if final.any() else "hero eval loss")
            if final.any():
                ax.scatter(ev["step"][final], ev["eval_loss"][final], color="C0", marker="*", s=80, zorder=4,
                           edgecolors="k", linewidths=0.5, label="hero final eval (every window)")
        if tr and tr.step:
            late = np.asarray(tr.lo)[len(tr.lo) // 10:]
            ax.set_ylim(min(float(np.nanmin(late)), float(np.nanpercentile(hero["loss"], 1))) - 0.05,
                        float(np.nanmax(np.asarray(tr.hi)[len(tr.hi) // 20:])) + 0.15)
    h = forecast.hero if forecast else None
    fl = h.final_loss if h else None
    if fl and h.total_steps:
        x = h.total_steps
        ax.errorbar([x], [fl["mean"]], yerr=[[fl["mean"] - fl["lo"]], [fl["hi"] - fl["mean"]]], fmt="D", color="C3",
                    capsize=5, label="final eval loss forecast")
    # monitor flags as legend entries: several early flags drawn as rotated labels overlap
    for i, f in enumerate(f for f in flags if f.get("first_step") is not None):
        ax.axvline(f["first_step"], color="C3" if f.get("severity") == "critical" else "C1",
                   ls=(":", "--", "-.")[i % 3], lw=1, label=f"{f.get('kind', 'flag')} from step {f['first_step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Hero proxy against its forecast")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "hero.png")


def plot_grad_norm(out: Path, runs: dict[str, pd.DataFrame], roles: dict[str, str], forecast: HeroForecast | None):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(runs)
    for i, name in enumerate(names):
        df = runs[name]
        if "grad_norm" not in df:
            continue
        frac = df["step"] / max(df["step"].max(), 1)
        is_hero = roles.get(name) == "hero"
        ax.plot(frac, df["grad_norm"].rolling(5, min_periods=1).mean(), lw=1.4 if is_hero else 0.8,
                color="k" if is_hero else _rung_color(i, len(names)), label=name)
    gn = forecast.grad_norm if forecast else None
    h = forecast.hero if forecast else None
    if gn and h.total_steps:
        total = h.total_steps
        x = np.asarray(gn["step"]) / total
        ax.fill_between(x, gn["lo"], gn["hi"], color="C3", alpha=0.15, label="hero envelope")
        ax.plot(x, gn["mean"], color="C3", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("fraction of training")
    ax.set_ylabel("grad norm (before clipping)")
    ax.set_title("Grad norm against the forecast envelope")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out, "grad_norm.png")


def plot_router(out: Path, runs: dict[str, pd.DataFrame], roles: dict[str, str]):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(runs)
    for i, name in enumerate(names):
        df = runs[name]
        c = "k" if roles.get(name) == "hero" else _rung_color(i, len(names))
        frac = df["step"] / max(df["step"].max(), 1)
        if "drop_frac_send" in df:
            a1.plot(frac, 100 * (df["drop_frac_send"] + df["drop_frac_recv"]).rolling(5, min_periods=1).mean(), color=c, lw=1, label=name)
        if "router_entropy" in df:
            a2.plot(frac, df["router_entropy"], color=c, lw=1, label=name)
    a1.axhline(7, color="C3", ls="--", lw=1, label="alert (7%)")
    a1.set_title("Dropped expert assignments (send + recv)")
    a1.set_ylabel("% of assignments")
    a2.set_title("Router entropy")
    a2.set_ylabel("nats")
    for a in (a1, a2):
        a.set_xlabel("fraction of training")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return _save(fig, out, "router.png")


def _table(rows: list[dict], cols: list[str] | None = None) -> str:
    if not rows:
        return "<p class='empty'>none</p>"
    cols = cols or [c for c in rows[0] if not isinstance(rows[0][c], (dict, list))]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, dict):  # a flag's evidence: its sentence
                v = v.get("text", json.dumps(v))
            if isinstance(v, float):
                v = f"{v:.4g}" if math.isfinite(v) else str(v)
            cells.append(f"<td>{html.escape(str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


REPLAN_COLS = ["n", "kind", "title", "allowed", "resume_step", "total_steps", "finish", "meets_deadline",
               "device_hours", "forecast_loss", "forecast_lo", "forecast_hi"]

CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;padding:0 1em}
h1{margin-bottom:.2em} h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:13px;margin:.5em 0} td,th{border:1px solid #ddd;padding:3px 7px;text-align:right} td:last-child{text-align:left}
th{background:#f4f4f4} img{max-width:100%;border:1px solid #eee} .verdict{font-size:16px;padding:.6em 1em;border-radius:6px}
.ok{background:#e8f5e9} .miss{background:#fdecea} .empty{color:#888}
"""


def build_report(
    out: Path,
    experiment: str,
    plan: list[dict],
    runs: dict[str, pd.DataFrame],
    forecast: HeroForecast | None,
    flags: list[dict],
    replan: list[dict],
    recommendation: str | None = None,
    hero_finished: bool = True,
    extras: dict[str, pd.DataFrame] | None = None,
) -> Path:
    """hero_finished: whether the hero's run is finished (its status and its final step); an
    unfinished hero is reported at its last step against the forecast trajectory there. extras:
    the experiment's finished extra runs (the hero's replicates among them are in the verdict)."""
    out.mkdir(parents=True, exist_ok=True)
    roles = {r["name"]: r["role"] for r in plan}
    finals = {}
    for name, df in runs.items():
        ev = df["eval_loss"].dropna() if "eval_loss" in df else pd.Series(dtype=float)
        if len(ev):
            finals[name] = float(ev.iloc[-1])
    hero_name = next((r["name"] for r in plan if r["role"] == "hero"), None)
    hero_df = runs.get(hero_name) if hero_name else None
    hero_actual = finals.get(hero_name) if hero_name and hero_finished else None

    imgs = {
        "law": plot_law(out, plan, finals, forecast, hero_actual),
        "rungs": plot_rungs(out, runs, roles, forecast),
        "hero": plot_hero(out, hero_df, forecast, flags),
        "grad_norm": plot_grad_norm(out, runs, roles, forecast),
        "router": plot_router(out, runs, roles),
    }
    # the hero's replicates (the same run at other seeds: <hero>-seed<k>) that have a final eval loss
    seeds = {}
    for name, df in sorted((extras or {}).items()):
        ev = df["eval_loss"].dropna() if "eval_loss" in df else pd.Series(dtype=float)
        if hero_name and name.startswith(f"{hero_name}-seed") and len(ev):
            seeds[name] = float(ev.iloc[-1])
    verdict = verdict_text(forecast, hero_actual, hero_df if not hero_finished else None,
                           replicates=seeds if hero_actual is not None else None)
    plan_cols = ["name", "role", "layers", "d_model", "total_params", "active_params", "steps", "tokens", "flops", "share_of_hero"]
    sections = [
        ("plan", "Plan", _table(plan, plan_cols)),
        ("forecast", "Scaling law and hero forecast",
         f"<p class='verdict {'ok' if verdict[1] else 'miss'}'>{html.escape(verdict[0])}</p><img src='{imgs['law']}' alt='scaling law'>"
         + _law_table(forecast)),
        ("rungs", "Rung loss curves and the curve model", f"<img src='{imgs['rungs']}' alt='rung curves'>"),
        ("hero", "Hero proxy against its forecast band", f"<img src='{imgs['hero']}' alt='hero vs forecast'>"),
        ("gradnorm", "Grad norm against its envelope", f"<img src='{imgs['grad_norm']}' alt='grad norm'>"),
        ("router", "Token drops and router entropy", f"<img src='{imgs['router']}' alt='drops and entropy'>"),
        ("flags", "Flags", _table(flags, ["severity", "kind", "first_step", "evidence"]) if flags else "<p class='empty'>no flags</p>"),
        ("replan", "Replan options",
         (f"<p><b>Recommendation:</b> {html.escape(recommendation)}</p>" if recommendation else "")
         + _table(replan, [c for c in REPLAN_COLS if replan and c in replan[0]] or None)),
    ]
    body = "".join(f"<section id='{sid}'><h2>{html.escape(title)}</h2>{content}</section>" for sid, title, content in sections)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(experiment)} ladder report</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(experiment)}</h1>"
            f"<p>Ladder report: {len([r for r in plan if r['role'] == 'rung'])} rungs and a hero.</p>{body}</body></html>")
    atomic_write_text(out / "index.html", page)
    atomic_write_text(out / "summary.json", json.dumps({"experiment": experiment, "verdict": verdict[0], "inside": verdict[1],
                                                         "hero_actual": hero_actual,
                                                         "hero_replicates": seeds if hero_actual is not None else {},
                                                         "forecast": forecast.final_loss if forecast else None},
                                                        indent=2))
    return out / "index.html"


def _law_table(forecast: HeroForecast | None) -> str:
    if not forecast:
        return ""
    law = {k: v for k, v in (forecast.law.to_dict() if forecast.law else {}).items() if isinstance(v, (int, float, str))}
    out = _table([law]) if law else ""
    bt = forecast.backtest
    if bt:
        out += (f"<p>Backtest: refitted without {html.escape(str(bt.held_out))}, the law predicts it at "
                f"{bt.predicted:.4f} against an actual {bt.actual:.4f} ({100 * bt.rel_error:+.2f}%); the hero's "
                "interval is widened by that error, scaled by how far beyond the ladder the hero lies.</p>")
    return out


LIVE_WINDOW = 25  # steps whose mean train loss stands for a live hero's loss (the plot's smoothing)


def verdict_text(forecast: HeroForecast | None, actual: float | None, live_df=None,
                 replicates: dict[str, float] | None = None) -> tuple[str, bool]:
    """The plain statement of the hero's final eval loss against the forecast interval (and of its
    finished replicates at other seeds, with the mean of them all); for a hero still running
    (live_df: its metrics so far, actual None), its step and its recent train loss against the
    forecast trajectory at that step. Errors are (actual - forecast) / actual."""
    if forecast is None:
        return "No forecast yet: run `ladder forecast` on the finished rungs.", False
    fl = forecast.final_loss
    level = int(round(100 * fl.get("level", 0.9)))
    if actual is None:
        final = f"final loss forecast {fl['mean']:.4f} ({level}% interval {fl['lo']:.4f} to {fl['hi']:.4f})"
        live = live_verdict(forecast, live_df)
        if live is not None:
            return f"{live[0]}; {final}.", live[1]
        return f"Hero forecast: {final}; the hero has no final eval loss yet.", False
    err = (actual - fl["mean"]) / actual
    inside = fl["lo"] <= actual <= fl["hi"]
    where = "inside" if inside else "OUTSIDE"
    text = (f"Hero final eval loss {actual:.4f} vs forecast {fl['mean']:.4f} ({level}% interval {fl['lo']:.4f} to "
            f"{fl['hi']:.4f}): error {100 * err:+.2f}%, {where} the interval.")
    if replicates:
        each = ", ".join(f"{name.rsplit('-', 1)[-1]} {v:.4f} ({100 * (v - fl['mean']) / v:+.2f}%)"
                         for name, v in replicates.items())
        mean = float(np.mean([actual, *replicates.values()]))
        held = sum(fl["lo"] <= v <= fl["hi"] for v in replicates.values())
        text += (f" Its replicates: {each}, {held} of {len(replicates)} inside; the mean of all "
                 f"{len(replicates) + 1} seeds {mean:.4f} ({100 * (mean - fl['mean']) / mean:+.2f}%).")
    if fl.get("regime_ok") is False:
        text += " The forecast's regime check warned (its rungs are not in the hero's regime): it was not to be trusted."
    return text, inside


def live_verdict(forecast: HeroForecast, df) -> tuple[str, bool] | None:
    """"Hero at step s of S: train loss x vs forecast y (band) ..." for an unfinished hero, or None
    when there is no step or no forecast trajectory to compare with."""
    if df is None or not len(df) or "step" not in df or "loss" not in df:
        return None
    total = forecast.hero.total_steps
    d = df[["step", "loss"]].apply(pd.to_numeric, errors="coerce").dropna().sort_values("step")
    d = d[np.isfinite(d["loss"])]
    if not len(d):
        return None
    step = int(d["step"].iloc[-1])
    head = f"Hero at step {step + 1} of {total}: not finished" if total else f"Hero at step {step + 1}: not finished"
    tr = forecast.trajectory
    steps, lo, mid, hi = (np.asarray(a or [], dtype=float) for a in ((tr.step, tr.lo, tr.loss, tr.hi) if tr else [None] * 4))
    loss = float(d["loss"].iloc[-LIVE_WINDOW:].mean())
    if not len(steps) or step < steps[0] or step > steps[-1]:
        return f"{head}, train loss {loss:.4f} (mean of the last {min(LIVE_WINDOW, len(d))} steps); no forecast at that step", False
    # the forecast's mean over the same steps as the loss's: a trajectory that carries the rungs' stream
    # deviations (analysis.forecast.hero) moves step by step as the loss does
    win = d["step"].to_numpy()[-LIVE_WINDOW:].astype(float)
    win = win[(win >= steps[0]) & (win <= steps[-1])]
    f_mid, f_lo, f_hi = (float(np.mean(np.interp(win, steps, a))) for a in (mid, lo, hi))
    inside = f_lo <= loss <= f_hi
    return (f"{head}, train loss {loss:.4f} (mean of the last {min(LIVE_WINDOW, len(d))} steps) vs forecast "
            f"{f_mid:.4f} at that step (mean over the same steps; band {f_lo:.4f} to {f_hi:.4f}): "
            f"{100 * (loss - f_mid) / loss:+.2f}%, {'inside' if inside else 'OUTSIDE'} the band"), inside
