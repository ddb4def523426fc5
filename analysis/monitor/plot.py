"""The picture of a live run against its forecast: loss over the band, grad norm over its envelope,
token drops over their budget, each flag marked where it starts."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast
from analysis.monitor.stats import column, rolling_median
from analysis.monitor.flags import MonitorReport
from core.fsutil import atomic_write_bytes

__all__ = ["plot_report"]

SEVERITY_COLOR = {"info": "tab:blue", "warning": "tab:orange", "critical": "tab:red"}


def plot_report(df: pd.DataFrame, report: MonitorReport, forecast: Forecast | None, out: str | Path,
                title: str = "") -> Path:
    """PNG of the live loss (and grad norm) over the forecast band, with the flags marked."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend

    steps = df["step"].to_numpy()
    gn = column(df, "grad_norm")
    ds, dr = column(df, "drop_frac_send"), column(df, "drop_frac_recv")
    drop = None
    if ds is not None or dr is not None:
        drop = np.nan_to_num(ds if ds is not None else 0.0) + np.nan_to_num(dr if dr is not None else 0.0)
        drop = np.broadcast_to(drop, steps.shape) if np.any(drop > 0) else None
    n_panels = 1 + (gn is not None) + (drop is not None)
    fig, axes = plt.subplots(n_panels, 1, figsize=(9, 2.2 + 2.3 * n_panels), sharex=True, squeeze=False)
    ax = axes[0, 0]
    if forecast is not None:
        ax.fill_between(forecast.traj_step, forecast.traj_lo, forecast.traj_hi, color="tab:green", alpha=0.2,
                        label="forecast band")
        ax.plot(forecast.traj_step, forecast.traj_loss, color="tab:green", lw=1, ls="--", label="forecast")
    loss = df["loss"].to_numpy(dtype=np.float64)
    ax.plot(steps, loss, color="0.6", lw=0.7, label="loss")
    k = max(report.settings.get("loss_jump_smooth", 5), 1)
    ax.plot(steps, rolling_median(np.where(np.isfinite(loss), loss, np.nan), k), color="black", lw=1.2,
            label=f"loss (median of {k})")
    fin = loss[np.isfinite(loss)]
    if len(fin):
        lo_y = np.nanmin(fin) if forecast is None else min(np.nanmin(fin), np.nanmin(forecast.traj_lo))
        ax.set_ylim(lo_y - 0.05 * abs(lo_y), np.nanpercentile(fin, 99) * 1.05)
    ax.set_ylabel("loss")
    seen = set()
    for f in report.flags:
        c = SEVERITY_COLOR[f.severity]
        for a in axes[:, 0]:
            a.axvline(f.first_step, color=c, lw=1, alpha=0.7)
        if f.kind not in seen:
            ax.annotate(f.kind, (f.first_step, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                        ha="right", fontsize=7, color=c)
            seen.add(f.kind)
    ax.legend(loc="upper right", fontsize=8)
    if gn is not None:
        a2 = axes[1, 0]
        if forecast is not None and forecast.gn_step is not None and forecast.gn_mean is not None:
            if forecast.gn_lo is not None and forecast.gn_hi is not None:
                a2.fill_between(forecast.gn_step, forecast.gn_lo, forecast.gn_hi, color="tab:green", alpha=0.2,
                                label="forecast envelope")
            a2.plot(forecast.gn_step, forecast.gn_mean, color="tab:green", lw=1, ls="--")
        a2.plot(steps, gn, color="tab:purple", lw=0.8, label="grad norm")
        for thr, c in ((report.settings["grad_norm_warn"], "tab:orange"), (report.settings["grad_norm_crit"], "tab:red")):
            a2.axhline(thr, color=c, lw=0.8, ls=":")
        a2.set_yscale("log")
        a2.set_ylabel("grad norm")
        a2.legend(loc="upper right", fontsize=8)
    if drop is not None:
        a3 = axes[-1, 0]
        a3.plot(steps, 100 * drop, color="tab:brown", lw=0.8, label="dropped assignments (send + recv)")
        a3.axhline(100 * report.settings["drop_budget"], color="tab:orange", lw=0.8, ls=":", label="budget")
        a3.set_ylabel("drops (%)")
        a3.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or f"live run vs forecast — worst flag: {report.worst or 'none'}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())
