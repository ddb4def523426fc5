"""The report in a real headless browser (Debian's chromium through chromedriver): every section
is there, every image loaded, and a screenshot is kept."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.forecast.file import HeroForecast

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["plan", "forecast", "rungs", "hero", "gradnorm", "router", "flags", "replan"]


def _fake_free_inputs():
    """Report inputs from real curves: the multipower loss curves stand in for four rungs and a hero."""
    from tests.refdata import MULTIPOWER as base
    runs, plan = {}, []
    for i, (size, name) in enumerate([("25M", "cosine_24000"), ("25M", "wsd_20000_24000"), ("100M", "cosine_24000"),
                                      ("100M", "wsd_20000_24000"), ("100M", "cosine_72000")]):
        df = pd.read_csv(base / size / f"{name}.csv")
        role = "hero" if i == 4 else "rung"
        rname = "hero" if role == "hero" else f"r{i}"
        df = df.assign(tokens=df["step"] * 1000, grad_norm=0.5 + 0.1 * np.sin(df["step"] / 500),
                       drop_frac_send=0.01, drop_frac_recv=0.005, router_entropy=1.5,
                       eval_loss=np.where(np.arange(len(df)) % 10 == 9, df["loss"], np.nan))
        df.loc[df.index[-1], "eval_loss"] = df["loss"].iloc[-1]
        runs[rname] = df
        plan.append({"name": rname, "role": role, "layers": 4 + i, "d_model": 64 * (i + 1), "total_params": 1e6 * (i + 1),
                     "active_params": 3e5 * (i + 1), "steps": int(df["step"].max()), "tokens": int(df["tokens"].max()),
                     "flops": 1e15 * 3 ** i, "share_of_hero": 3 ** (i - 4)})
    hero = runs["hero"]
    steps = hero["step"].to_numpy()
    forecast = HeroForecast.from_dict({
        "hero": {"name": "hero", "flops": 1e15 * 81, "total_steps": int(steps.max()),
                 "final_loss": {"mean": 3.0, "lo": 2.9, "hi": 3.1, "level": 0.9}},
        "law": {"E": 2.0, "A": 10.0, "alpha": 0.1, "curve": {"flops": [1e15, 1e17], "loss": [3.4, 3.0], "lo": [3.3, 2.9], "hi": [3.5, 3.1]}},
        "trajectory": {"step": steps.tolist(), "loss": (hero["loss"] + 0.01).tolist(), "lo": (hero["loss"] - 0.05).tolist(),
                       "hi": (hero["loss"] + 0.05).tolist()},
        "grad_norm": {"step": steps.tolist(), "mean": [0.5] * len(steps), "lo": [0.3] * len(steps), "hi": [0.8] * len(steps)},
    })
    flags = [{"kind": "loss_band", "severity": "warning", "first_step": int(steps[len(steps) // 2]), "evidence": "3 points above the band"}]
    replan = [{"option": 1, "name": "keep", "finish": "2026-12-01", "gpu_hours": 10.0, "final_loss": 3.0}]
    return plan, runs, forecast, flags, replan


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from analysis.report import build_report

    out = tmp_path_factory.mktemp("report")
    plan, runs, forecast, flags, replan = _fake_free_inputs()
    return build_report(out, "browser_check", plan, runs, forecast, flags, replan, "keep the plan")


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    assert os.path.exists(chromium) and os.path.exists(driver), "Debian's chromium and chromium-driver are needed (make test installs them)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1200,900"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def test_report_opens_in_chromium_with_every_image_and_section(report, tmp_path_factory):
    d = _driver()
    try:
        d.get(report.as_uri())
        ids = d.execute_script("return Array.from(document.querySelectorAll('section')).map(s => s.id)")
        assert ids == SECTIONS
        imgs = d.execute_script(
            "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
        assert len(imgs) == 5 and all(ok for _, ok in imgs), imgs
        shot = Path(os.environ.get("REPORT_SCREENSHOT_DIR", report.parent)) / "report.png"
        d.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        d.quit()


def test_report_states_the_hero_error_plainly(report):
    text = report.read_text()
    assert "vs forecast 3.0000" in text and "error" in text
    assert ("inside the interval" in text) or ("OUTSIDE the interval" in text)
