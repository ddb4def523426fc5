"""`ladder submit` as a real process: Ctrl-C stops it cleanly; SIGKILL mid-sweep and a rerun
still train every spec exactly once.

One sweep of four specs goes through three submissions: the first is interrupted with SIGINT (as a terminal's
Ctrl-C, to the whole process group), the second is SIGKILLed with one run finished and another
mid-way, the third finishes the sweep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.base import read_metrics, read_status
from ladder import ledger, tracking
from ladder.experiment import load_experiment
from tests.support import tiny_changes

pytestmark = pytest.mark.slow

STEPS = 40
# four rungs: a Ctrl-C that comes late (a busy machine) can leave the first two finished, and the
# second submission still needs two to train (one finished and one mid-way when it is killed)
RUNGS = [("a", {}), ("b", {"seed": 1}), ("c", {"seed": 2}), ("d", {"seed": 3})]


def attempts(run_dir: Path) -> list[dict]:
    p = run_dir / "attempts.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []


def last_step(run_dir: Path) -> int:
    rec = ledger.last_metrics(run_dir)
    return -1 if rec is None else rec["step"]


def _terminal_sigint() -> None:
    """A Ctrl-C from a terminal: SIGINT at its default, even where the tests themselves run with it
    ignored (a non-interactive shell's `make test &` hands its background jobs SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_submit(path: Path, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_terminal_sigint,
    )


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"ladder submit exited ({proc.returncode}) before {what}:\n{err[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def story(tmp_path_factory, mlflow_template):
    import shutil

    tmp = tmp_path_factory.mktemp("interrupt")
    path = tmp / "intr.py"
    path.write_text(
        "from ladder.experiment import Experiment\nfrom ladder.presets import micro_spec\n"
        f"BASE = {tiny_changes(STEPS, 10)!r}\n"
        f"EXPERIMENT = Experiment(name='intr', rungs=tuple(micro_spec(n, **{{**BASE, **c}}) for n, c in {RUNGS!r}))\n"
    )
    root = tmp / ".ladder"
    root.mkdir()
    shutil.copy(mlflow_template, root / "mlflow.db")
    exp = load_experiment(path)
    dirs = {s.name: ledger.run_dir_for(root, "intr", s) for s in exp.rungs}
    out: dict = {"path": path, "root": root, "exp": exp, "dirs": dirs}

    # 1. Ctrl-C once a run is past its first checkpoint
    p = start_submit(path, root)
    wait_for(lambda: any(last_step(d) >= 12 for d in dirs.values()), p, "a run passed step 12")
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=300)
    out["sigint"] = {
        "rc": p.returncode,
        "stderr": err,
        "states": {n: read_status(d).get("state") for n, d in dirs.items()},
        "reasons": {n: read_status(d).get("reason") for n, d in dirs.items()},
        "locks": sorted(x.name for x in root.rglob("locks/*.lock")),
        "frame": ledger.runs_frame(root, path),
        "steps": {n: last_step(d) for n, d in dirs.items()},
    }

    # 2. SIGKILL with one run finished and another mid-way, both by this submission: what the
    # first one left (a run stopped past step 12, maybe one finished) must not satisfy it, or the
    # kill could come before this submission has even opened its parent run
    first = {n: (read_status(d).get("state"), last_step(d), len(attempts(d))) for n, d in dirs.items()}
    p = start_submit(path, root)

    def mid_sweep() -> bool:
        now = {n: (read_status(d).get("state"), last_step(d), len(attempts(d))) for n, d in dirs.items()}
        done = [n for n, (state, _, _) in now.items() if state == "finished" and first[n][0] != "finished"]
        mid = [n for n, (state, step, tries) in now.items()
               if state != "finished" and tries > first[n][2] and step >= max(12, first[n][1] + 3)]
        return bool(done) and bool(mid)

    wait_for(mid_sweep, p, "one run finished and another mid-way")
    out["finished_before_kill"] = [n for n, d in dirs.items() if read_status(d).get("state") == "finished"]
    out["attempts_before_rerun"] = {n: len(attempts(d)) for n, d in dirs.items()}
    p.send_signal(signal.SIGKILL)  # the driver only: its local Ray goes down with it
    out["killed_stderr"] = p.communicate(timeout=300)[1]

    # 3. run it again to the end
    t0 = time.perf_counter()
    final = subprocess.run(
        [sys.executable, "-m", "ladder.cli", "submit", str(path), "--root", str(root)],
        capture_output=True, text=True, timeout=1200,  # a hang guard: beside three busy loops it took over 400 s
    )
    out["rerun"] = {"rc": final.returncode, "stderr": final.stderr, "s": time.perf_counter() - t0}
    return out


def test_ctrl_c_stops_every_run_cleanly_and_says_how_to_resume(story):
    s = story["sigint"]
    assert s["rc"] == 130, s["stderr"][-2000:]
    assert "Resume with" in s["stderr"] and f"ladder submit {story['path']}" in s["stderr"]
    started = [n for n, st in s["states"].items() if st is not None and st != "pending"]
    assert started, "no run had started"
    for n in started:
        assert s["states"][n] in ("failed", "finished"), s["states"]
        if s["states"][n] == "failed":
            assert s["reasons"][n] == "interrupted"
    assert s["locks"] == []  # every claim released
    frame = s["frame"].set_index("name")
    assert set(frame["state"]) <= {"failed", "finished", "pending"}


def test_a_killed_submission_rerun_trains_every_spec_exactly_once(story):
    r, root, exp, dirs = story["rerun"], story["root"], story["exp"], story["dirs"]
    assert r["rc"] == 0, r["stderr"][-3000:]
    assert story["finished_before_kill"], "the kill came before any run finished"
    uri = tracking.default_tracking_uri(root)
    children = tracking.child_runs(uri, "intr")
    assert sorted(c.data.tags["spec_id"] for c in children) == sorted(s.id for s in exp.rungs), r["stderr"][-3000:]
    assert {c.info.status for c in children} == {"FINISHED"}, r["stderr"][-3000:]
    assert sorted(p.name for p in (root / "runs" / "intr").iterdir()) == sorted(d.name for d in dirs.values())
    for spec in exp.rungs:
        d = dirs[spec.name]
        assert [m["step"] for m in read_metrics(d)] == list(range(STEPS)), spec.name
        assert read_status(d)["state"] == "finished"
        run = next(c for c in children if c.data.tags["spec_id"] == spec.id)
        logged = tracking.iter_metric_points(uri, run.info.run_id, ["loss"])["loss"]
        assert sorted(logged) == list(range(STEPS)), f"{spec.name}: MLflow steps lost or duplicated"
    parents = tracking.client(uri).search_runs([tracking.experiment_id(uri, "intr")], "tags.`ladder.kind` = 'submission'")
    # the SIGKILLed submission's parent run is closed as KILLED by the rerun, not left RUNNING.
    # The killed driver's Ray worker may finish its run before Ray reaps it: then the rerun has
    # nothing to train, opens no parent of its own, and only catches MLflow up
    statuses = sorted(p.info.status for p in parents)
    seen = [(p.info.status, p.data.tags.get("pid"), p.info.run_name) for p in parents]
    n_parents = 2 if "nothing to train" in r["stderr"] else 3
    assert len(statuses) == n_parents and "RUNNING" not in statuses, (
        seen, "SIGINT:", story["sigint"]["stderr"][-3000:], "SIGKILL:", story.get("killed_stderr", "")[-3000:],
        "rerun:", r["stderr"][-3000:])
    for name in story["finished_before_kill"]:
        # a run finished before the kill is not touched again
        assert len(attempts(dirs[name])) == story["attempts_before_rerun"][name]
