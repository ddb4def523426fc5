"""TorchEngine.train runs a spec with model.ep_size > 1 in ep_size real processes (torchrun +
engines/torch/parallel/train.py, dp 1; gloo here, NCCL on GPUs) and yields rank 0's records: the same
losses as the one-process engine with the shards emulated, each step once across an
interrupted launch and its resume, and a clear error for a bad layout switch."""

from __future__ import annotations

import pytest

from engines.base import read_metrics, read_status
from engines.torch.engine import TorchEngine
from engines.options import EngineOptions, OptionsError
from engines.torch.parallel.layout import LayoutError
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow

# init_std 0.3 and capacity factors 1.0: the routed experts and the drops move the loss
SPEC = micro_spec("ep2-launch", **{"model.ep_size": 2, "model.dispatch": "capacity", "model.n_waves": 2,
                                    "model.capacity_factor_send": 1.0, "model.capacity_factor_recv": 1.0,
                                    "model.init_std": 0.3, "data.total_tokens": 6 * 64 * 8,
                                    "run.eval_every": 3, "run.checkpoint_every": 3})
CPU_ENV = {"OMP_NUM_THREADS": "1"}
EMULATE = EngineOptions(torch_ep="emulate", cpu_threads=1)
PROCESSES = EngineOptions(torch_ep="processes", cpu_threads=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("ep_launch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # (the ranks' environment)
        single = list(TorchEngine("cpu", EMULATE).train(SPEC, root / "single"))
        whole = list(TorchEngine("cpu", PROCESSES).train(SPEC, root / "ranks"))
        whole_file = read_metrics(root / "ranks")
        # as a kill after the step-3 checkpoint leaves the run: its later records stay in the file
        shutil.rmtree(root / "ranks" / "sharded" / "step_00000006")
        rest = list(TorchEngine("cpu", PROCESSES).train(SPEC, root / "ranks"))
    return {"root": root, "single": single, "whole": whole, "whole_file": whole_file, "rest": rest}


def test_processes_give_the_emulated_losses_and_drops(runs):
    single = read_metrics(runs["root"] / "single")
    ranks = runs["whole_file"]
    assert [r["step"] for r in ranks] == [r["step"] for r in single] == list(range(SPEC.total_steps))
    assert [m.step for m in runs["whole"]] == list(range(SPEC.total_steps))  # yielded as written
    for a, b in zip(ranks, single):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-5)
        assert (a["drop_frac_send"], a["drop_frac_recv"]) == (b["drop_frac_send"], b["drop_frac_recv"])
    assert any(r["drop_frac_recv"] > 0 for r in single)
    assert (runs["root"] / "ranks" / "mesh.json").exists()  # written by the ranks, never by one process


def test_a_resumed_launch_yields_only_its_steps_and_the_file_holds_each_once(runs):
    assert [m.step for m in runs["rest"]] == [3, 4, 5]
    ranks = read_metrics(runs["root"] / "ranks")
    assert [r["step"] for r in ranks] == list(range(SPEC.total_steps))
    single = {m.step: m.loss for m in runs["single"]}
    for m in runs["rest"]:
        assert m.loss == pytest.approx(single[m.step], rel=2e-5)
    assert read_status(runs["root"] / "ranks")["state"] == "finished"


def test_closing_the_generator_ends_every_rank(tmp_path, monkeypatch):
    import subprocess
    import time

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    long = SPEC.replace(**{"data.total_tokens": 2000 * 64 * 8, "options.torch_ep": "processes",
                           "options.cpu_threads": 1})
    gen = TorchEngine("cpu", PROCESSES).train(long, tmp_path / "run")
    assert [next(gen).step for _ in range(2)] == [0, 1]
    gen.close()

    def alive() -> str:
        return subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True).stdout

    deadline = time.time() + 300  # a hang guard
    while alive() and time.time() < deadline:
        time.sleep(0.2)
    assert alive() == ""
    assert read_status(tmp_path / "run")["state"] != "finished"


def test_auto_emulates_where_there_are_not_enough_gpus(monkeypatch):
    import torch

    from engines.torch.parallel.launch import use_processes

    assert not use_processes(SPEC, torch.device("cpu"), EngineOptions(torch_ep="auto"))
    assert use_processes(SPEC, torch.device("cpu"), PROCESSES)
    assert not use_processes(micro_spec("one", **{"model.ep_size": 1}), torch.device("cpu"), PROCESSES)


def test_a_bad_layout_switch_is_refused_by_name():
    from pydantic import ValidationError

    from engines.options import Options

    with pytest.raises(OptionsError, match="MOE_LADDER_OPTIONS torch_ep='sometimes'"):
        Options.from_env({"MOE_LADDER_OPTIONS": "torch_ep=sometimes"})
    with pytest.raises(ValidationError, match="options.torch_ep"):
        SPEC.replace(**{"options.torch_ep": "sometimes"})


def test_the_spec_options_pick_the_layout_where_the_engine_is_given_none(tmp_path):
    """TorchEngine without options runs under the spec's options section (the environment is the CLI's)."""
    spec = SPEC.replace(**{"options.torch_ep": "processes", "options.cpu_threads": 1,
                           "data.total_tokens": SPEC.data.tokens_per_step * 2})
    list(TorchEngine("cpu").train(spec, tmp_path / "run"))
    assert (tmp_path / "run" / "mesh.json").exists()  # its ranks trained it
    assert read_status(tmp_path / "run")["options"]["torch_ep"] == "processes"


def test_ladder_train_runs_the_ranks(tmp_path):
    import os
    import subprocess
    import sys

    from core.spec import save_spec

    path = save_spec(SPEC, tmp_path / "spec.yaml")
    env = dict(os.environ, **CPU_ENV, MOE_LADDER_OPTIONS="torch_ep=processes,cpu_threads=1")
    out = subprocess.run([sys.executable, "-m", "ladder.cli", "train", str(path), "--run-dir", str(tmp_path / "run"),
                          "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"finished step {SPEC.total_steps}/{SPEC.total_steps}" in out.stderr
    assert (tmp_path / "run" / "mesh.json").exists()


KILLED_DRIVER = """
import sys
from engines.torch.engine import TorchEngine
from core.spec import load_spec
for m in TorchEngine("cpu").train(load_spec(sys.argv[1]), sys.argv[2]):
    print(m.step, flush=True)
"""


def test_a_sigkilled_launcher_takes_every_rank_with_it(tmp_path):
    """A Ray worker killed with SIGKILL cannot close the generator: the kernel's parent-death
    signal ends torchrun, which ends its ranks, so a retry never finds a second writer."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from core.spec import save_spec

    long = SPEC.replace(**{"data.total_tokens": 2000 * 64 * 8, "options.torch_ep": "processes",
                           "options.cpu_threads": 1})
    path = save_spec(long, tmp_path / "spec.yaml")
    env = dict(os.environ, **CPU_ENV)  # the spec sets the layout: the engine reads no environment
    run = tmp_path / "run"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(path), str(run)], stdout=subprocess.PIPE,
                              text=True, env=env)
    assert driver.stdout.readline().strip() == "0"  # the ranks are training

    def alive() -> str:
        return subprocess.run(["pgrep", "-f", str(run)], capture_output=True, text=True).stdout

    assert alive()
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 300  # a hang guard
    while alive() and time.time() < deadline:
        time.sleep(0.2)
    assert alive() == ""


def test_a_diverging_ep_run_raises_diverged_at_its_step(tmp_path, monkeypatch):
    from engines.base import DivergedError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = micro_spec("ep2-nan", **{"model.ep_size": 2, "optim.peak_lr": 1e6, "optim.grad_clip": 1e9,
                                     "run.checkpoint_every": 1})
    with pytest.raises(DivergedError, match="at step"):
        list(TorchEngine("cpu", PROCESSES).train(spec, tmp_path / "run"))
    assert read_status(tmp_path / "run")["state"] == "diverged"


def test_a_checkpoint_of_another_spec_is_refused_in_one_line_and_nothing_is_lost(runs, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import shutil

    run = runs["root"] / "ranks"
    shutil.rmtree(run / "sharded" / "step_00000006")  # records 3..5 now lie past the last checkpoint
    before = (run / "metrics.jsonl").read_text()
    other = SPEC.replace(seed=SPEC.seed + 1)
    with pytest.raises(LayoutError, match=r"belongs to spec .* not this spec") as err:
        list(TorchEngine("cpu", PROCESSES).train(other, run))
    assert "\n" not in str(err.value)
    assert (run / "metrics.jsonl").read_text() == before  # the refused launch lost nothing


def test_an_ep_spec_emulated_on_one_gpu_says_how_to_split_it(monkeypatch):
    import torch

    from engines.torch.parallel.launch import emulation_warning

    auto = EngineOptions(torch_ep="auto")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    note = emulation_warning(SPEC, torch.device("cuda"), auto)
    assert "model.ep_size 2" in note and "1 GPU(s) visible" in note and "hardware.task_gpus 2" in note
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # ranks, not emulation
    assert emulation_warning(SPEC, torch.device("cuda"), auto) is None
    assert emulation_warning(SPEC, torch.device("cpu"), auto) is None  # CPU runs emulate by design
