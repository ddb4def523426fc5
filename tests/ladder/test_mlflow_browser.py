"""The MLflow UI (a real `mlflow server` on 127.0.0.1, Debian's headless chromium) opens a ladder's
experiment and runs in its model-training view, not the GenAI one, through the links the product
writes: the experiment's runs table, and a run's charts with its loss, eval loss and grad norm."""

from __future__ import annotations

import time

import pytest

from engines.registry import get_engine
from ladder import ledger, tracking
from ladder.mlflow_store import run_ui_url, ui_url
from tests.analysis.test_report_browser import _driver
from tests.ladder.test_tracking_server import Server
from tests.support import tiny_spec

pytestmark = pytest.mark.slow

GENAI_ONLY = ("Judges", "Sessions", "Evaluations")  # the GenAI view's side bar and its name for a run
WAIT_S = 120  # a hang guard: the UI's bundle loads in seconds


@pytest.fixture(scope="module")
def logged(tmp_path_factory, mlflow_template):
    tmp = tmp_path_factory.mktemp("mlflow-ui")
    server = Server(tmp, mlflow_template)
    server.start()
    spec = tiny_spec("ui-view", steps=30, **{"run.eval_every": 10})  # periodic evals: an eval_loss curve
    run_dir = tmp / "run"
    ledger.write_spec_file(run_dir, spec)
    for _ in get_engine("torch").train(spec, run_dir):
        pass
    tracker = tracking.RunTracker(server.uri, "ui-view", spec, run_dir)
    tracker.upload()
    tracker.set_final("finished")
    exp_id = tracking.experiment_id(server.uri, "ui-view")
    yield server, exp_id, tracker.run_id
    server.kill()


@pytest.fixture(scope="module")
def browser():
    d = _driver()
    d.set_window_size(1400, 8000)  # tall enough that the charts, drawn as they scroll into view, are all drawn
    yield d
    d.quit()


def _page_text(browser, url: str, *wanted: str) -> str:
    """The page's text once every `wanted` string shows (or the hang guard's time is up)."""
    browser.get(url)
    deadline = time.time() + WAIT_S
    text = ""
    while time.time() < deadline:
        text = browser.find_element("tag name", "body").text
        if all(w in text for w in wanted):
            break
        time.sleep(0.5)
    return text


def test_the_experiment_link_opens_the_runs_table_in_the_training_view(logged, browser):
    server, exp_id, _ = logged
    text = _page_text(browser, ui_url(server.uri, exp_id), "ui-view-", "Model registry")
    assert "ui-view-" in text and "Model registry" in text, text[:2000]
    assert not [w for w in GENAI_ONLY if w in text], text[:2000]


def test_a_run_link_opens_its_charts_of_loss_eval_and_grad_norm_in_the_training_view(logged, browser):
    server, exp_id, run_id = logged
    charts = ("loss", "eval_loss", "grad_norm")
    text = _page_text(browser, run_ui_url(server.uri, exp_id, run_id, charts=True), "Model metrics", "grad_norm", "eval_loss")
    lines = set(text.splitlines())
    assert [c for c in charts if c in lines] == list(charts), text[:3000]
    assert not [w for w in GENAI_ONLY if w in text], text[:2000]
