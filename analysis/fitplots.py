"""PNG plots of fits for the CLI's --png: the data, the fitted law or curves, and their intervals.

Each function renders to memory and writes one file atomically (core.fsutil), returning its path.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from core.fsutil import atomic_write_bytes  # noqa: E402

__all__ = ["plot_law_fit", "plot_envelope_fit", "plot_curves", "plot_isoflop"]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    return atomic_write_bytes(Path(path), buf.getvalue())


def plot_law_fit(fit, N, D, loss, path: Path, title: str = "") -> Path:
    """Loss against compute 6ND with the law's prediction per point and its interval, and predicted
    against observed."""
    N, D, loss = (np.asarray(a, dtype=np.float64) for a in (N, D, loss))
    p = fit.predict(N, D)
    C = 6 * N * D
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    sc = ax1.scatter(C, loss, c=np.log10(N), s=12, cmap="viridis", label="data")
    ax1.errorbar(C, p["loss"], yerr=[p["loss"] - p["lo"], p["hi"] - p["loss"]], fmt="none", ecolor="0.6", lw=0.6,
                 label=f"{100 * fit.level:.0f}% prediction interval")
    ax1.set_xscale("log"), ax1.set_xlabel("C = 6ND (FLOPs)"), ax1.set_ylabel("loss")
    fig.colorbar(sc, ax=ax1, label="log10 N")
    ax1.legend(fontsize=8)
    lim = [min(loss.min(), p["loss"].min()), max(loss.max(), p["loss"].max())]
    ax2.plot(lim, lim, color="0.5", lw=0.8)
    ax2.scatter(loss, p["loss"], s=10)
    ax2.set_xlabel("observed loss"), ax2.set_ylabel("fitted loss")
    fig.suptitle(title or fit._LAW, fontsize=10)
    return _save(fig, path)


def plot_envelope_fit(fit, C, loss, path: Path, title: str = "") -> Path:
    C, loss = np.asarray(C, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    grid = np.geomspace(C.min() / 2, C.max() * 8, 100)
    p = fit.predict(grid)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.fill_between(grid, p["lo"], p["hi"], color="C0", alpha=0.2, label=f"{100 * fit.level:.0f}% prediction interval")
    ax.plot(grid, p["loss"], color="C0", label=fit._LAW)
    ax.scatter(C, loss, color="k", s=14, zorder=3, label="data")
    ax.set_xscale("log"), ax.set_xlabel("C (FLOPs)"), ax.set_ylabel("loss"), ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def plot_curves(rows: Sequence[dict], path: Path, title: str = "") -> Path:
    """rows: {"name", "step", "loss" (or None), "pred", "lo", "hi" (or None), "train": bool}."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(rows):
        col = f"C{i % 10}"
        if r.get("loss") is not None:
            ax.plot(r["step"], r["loss"], color=col, lw=0.8, alpha=0.6)
        ax.plot(r["step"], r["pred"], color=col, lw=1.4, ls="-" if r.get("train") else "--",
                label=f"{r['name']} ({'fit' if r.get('train') else 'predicted'})")
        if r.get("lo") is not None:
            ax.fill_between(r["step"], r["lo"], r["hi"], color=col, alpha=0.15)
    ax.set_xlabel("step"), ax.set_ylabel("loss"), ax.legend(fontsize=7)
    ax.set_title(title or "loss curves: data (thin), model (thick), bands (shaded)", fontsize=10)
    return _save(fig, path)


def plot_isoflop(N, C, loss, groups, fit, path: Path) -> Path:
    N, C, loss = (np.asarray(a, dtype=np.float64) for a in (N, C, loss))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.scatter(N, loss, c=groups, s=10, cmap="viridis")
    for m in fit.minima:
        ax1.scatter([m["N"]], [m["loss"]], marker="x", color="r")
    ax1.set_xscale("log"), ax1.set_xlabel("N"), ax1.set_ylabel("loss"), ax1.set_title("IsoFLOP profiles and minima")
    cs = np.array([m["C"] for m in fit.minima])
    ax2.scatter(cs, [m["N"] for m in fit.minima], label="N*")
    grid = np.geomspace(cs.min(), cs.max(), 50)
    ax2.plot(grid, [fit.optimal(c)["N"] for c in grid], label=f"N* ~ C^{fit.a:.3f}")
    ax2.scatter(cs, [m["D"] for m in fit.minima], label="D*")
    ax2.plot(grid, [fit.optimal(c)["D"] for c in grid], label=f"D* ~ C^{fit.b:.3f}")
    ax2.set_xscale("log"), ax2.set_yscale("log"), ax2.set_xlabel("C"), ax2.legend(fontsize=8)
    return _save(fig, path)
