"""A submission stops its workers through the stop marker (ledger.request_stop), not ray.cancel:
train_task, run in a thread here as a Ray worker runs it, ends at the next step with the run
marked interrupted and its claim released, and a task that starts after the request trains
nothing."""

import threading
import time

from engines.base import read_metrics, read_status
from ladder import ledger
from ladder.worker import train_task
from tests.support import tiny_spec


def _start(spec, root, owner):
    rd = ledger.run_dir_for(root, "stop", spec)
    rd.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(train_task(spec.model_dump_json(), str(rd), {"root": str(root), "owner": owner})))
    t.start()
    return rd, t, out


def test_a_stop_request_ends_the_run_at_its_next_step(tmp_path):
    spec = tiny_spec("long", steps=400, checkpoint_every=50)
    rd, t, out = _start(spec, tmp_path, "sub1")
    deadline = time.time() + 300  # a hang guard
    while time.time() < deadline and len(read_metrics(rd)) < 3:
        time.sleep(0.02)
    assert len(read_metrics(rd)) >= 3, "the run never reached step 3"
    ledger.request_stop(tmp_path, "sub1")
    t.join(timeout=600)
    assert not t.is_alive()
    assert out["outcome"] == "interrupted"
    assert read_status(rd)["state"] == "failed" and read_status(rd)["reason"] == "interrupted"
    assert len(read_metrics(rd)) < spec.total_steps
    assert not list(ledger.locks_dir(rd).glob("*.lock"))  # the claim was released


def test_a_task_started_after_the_request_trains_nothing(tmp_path):
    ledger.request_stop(tmp_path, "sub2")
    rd, t, out = _start(tiny_spec("late", steps=20), tmp_path, "sub2")
    t.join(timeout=600)
    assert out["outcome"] == "interrupted" and read_metrics(rd) == []
    ledger.clear_stop(tmp_path, "sub2")
    assert not ledger.stop_path(tmp_path, "sub2").exists()


def test_another_submissions_request_does_not_stop_a_run(tmp_path):
    ledger.request_stop(tmp_path, "someone-else")
    rd, t, out = _start(tiny_spec("mine", steps=20), tmp_path, "sub3")
    t.join(timeout=600)
    assert out["outcome"] == "finished" and len(read_metrics(rd)) == 20
