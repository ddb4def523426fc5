"""The fault suite: healthy replicates and injected faults of an experiment's hero, judged by the
monitor as `ladder compare --follow` would have judged them live.

    .venv/bin/python bench/faults.py EXPERIMENT.py [--forecast forecast.json] [--seeds 1,2,3,4] \
        [--stop 0.4] [--onset 0.2] [--only NAME ...] [--out DIR] [--healthy-runs RUN_DIR ...] [--jobs N]
    .venv/bin/python bench/faults.py --tiny --out DIR     (the CI scale: tests/bench/test_faults.py)

What it runs (every run really trains, with the hero's engine, up to `--stop` of its steps: a
monitor has to decide early):

- healthy replicates: the hero with other seeds (`--seeds`; seed 0 is the hero itself). They
  calibrate the monitor (analysis.monitor.calib), written to OUT/calibration.json; each replicate
  is then judged against a calibration from the others (leave one out), so its flags are false
  alarms on a run the calibration never saw.
- faults, on the hero's own seed, each from `--onset` of training (or from step 0 where the fault
  is the configuration itself), judged against the calibration from all the replicates:

  | fault                | made by                                                               |
  |----------------------|-----------------------------------------------------------------------|
  | lr_x4, lr_x0.25      | the spec: optim.peak_lr x4, x0.25                                     |
  | no_warmup            | the spec: schedule.warmup_steps 0                                     |
  | clip_off_lr_spike    | the hook: from onset clipping off (grad_clip 1e6), LR x30 for 5 steps  |
  | mixture_switch       | the spec: a data phase from onset on reading only the smallest source |
  | small_source_looped  | the hook: from onset the same 2 batches over and over                 |
  | corrupted_batch      | the hook: the batch at onset replaced by uniform random token ids     |
  | router_collapse      | the hook: every router's weights x30 at onset (one expert per token)  |
  | nan                  | the hook: LR NaN at onset                                             |
  | resume_wrong_step    | the hook: at onset the initial weights and optimizer (step 0's)       |
  | replayed_tokens      | the hook: from onset the batches of 10% of training back again        |
  | throughput_drop      | the hook: each step from onset waits 9x the median step time          |

Healthy replicates trained elsewhere (full runs of the hero at other seeds, e.g. `ladder submit`'s run
directories) are given with `--healthy-runs`: they are judged over their whole run and calibrate the
monitor as they are, nothing is trained for them. `--jobs N` trains the faults N at a time in
subprocesses sharing the device; their step rate then depends on their neighbours, so their
throughput flags are not counted (the row says so), and the faults whose flag is the rate
(throughput_drop) train alone afterwards. `--shared-machine` says the whole suite trains beside
other work (a CI machine's CPUs): no run's throughput flags are counted, the healthy replicates'
included, and throughput_drop is refused.

A hook is a Trainer callback (engines.trainer.Callback, `callbacks=` of the Trainer, none in a
real run), built by the suite with the step module and token stream it hands the Trainer: it
changes what a step reads (its batch, its LR) or the module's state (save_arrays/load_arrays),
never the Trainer's own state. The spec changes are ordinary specs, run under their own ids.

The detection table (OUT/faults.json and OUT/faults.md): for each fault its onset, the first
step a warning or critical flag was raised, the flag, its worst severity, and the delay as a share
of the hero's training steps; for each healthy replicate, every flag it raised. The monitor is
replayed on the run's records as they grew (every 1% of training), so "first step flagged" is the
step `compare --follow` would have printed it at.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from analysis.forecast.file import Forecast, load_forecast
from analysis.runs.metrics import read_metrics_frame
from analysis.monitor.watch import SEVERITY_RANK, MonitorSettings, monitor
from analysis.monitor.calib import Calibration, calibrate
from core.fsutil import atomic_write_text
from core.rundir import RunDir
from core.spec import Spec, load_spec, save_spec
import torch

from engines.base import DivergedError
from engines.data import TokenStream
from engines.options import EngineOptions
from engines.torch.engine import TorchStep, cpu_threads, default_device
from engines.registry import get_engine
from engines.trainer import Callback, Trainer
from ladder.experiment import load_experiment
from ladder.presets import micro_spec

__all__ = ["FAULTS", "Fault", "run_suite", "main"]


# ---- the faults ------------------------------------------------------------------------------


@dataclass
class Fault:
    """A fault: a spec change and/or a hook: hook(spec, onset, module, stream) -> the run's
    Callback (module and stream: the step module and token stream the run's Trainer is given)."""

    name: str
    what: str
    spec_change: Callable[[Spec, int], dict[str, Any]] | None = None
    hook: Callable[[Spec, int, Any, Any], Callback] | None = None
    from_start: bool = False  # the configuration itself is the fault: its onset is step 0
    gross: bool = False  # must be caught within 2% of training (else 10%)
    critical: bool = False  # must be critical


class Hook(Callback):
    """A fault's Trainer callback: fn(step, batch, lr) -> (batch, lr) before each step."""

    def __init__(self, fn: Callable[[int, np.ndarray, float], tuple[np.ndarray, float]]):
        self.fn = fn

    def pre_step(self, step: int, batch_BS1: np.ndarray, lr: float) -> tuple[np.ndarray, float]:
        return self.fn(step, batch_BS1, lr)


def _router_names(params: dict) -> list[str]:
    return [k for k in params if k.endswith("moe.router") or k.endswith("moe.router_bias")]


def _hook_lr_spike(spec: Spec, onset: int, module, stream) -> Hook:
    """From the onset the step module trains unclipped (its spec's grad_clip 1e6: the torch step reads
    it every step), and the LR is x30 for 5 steps."""
    def hook(step, batch, lr):
        if step == onset and hasattr(module, "spec"):
            module.spec = module.spec.replace(**{"optim.grad_clip": 1e6})
        return batch, (lr * 30.0 if onset <= step < onset + 5 else lr)
    return Hook(hook)


def _hook_looped(spec: Spec, onset: int, module, stream) -> Hook:
    def hook(step, batch, lr):
        if step < onset:
            return batch, lr
        return stream.batch(onset + (step - onset) % 2), lr
    return Hook(hook)


def _hook_corrupt(spec: Spec, onset: int, module, stream) -> Hook:
    rng = np.random.default_rng(1234)

    def hook(step, batch, lr):
        if step != onset:
            return batch, lr
        return rng.integers(0, spec.model.vocab_size, size=batch.shape).astype(batch.dtype), lr
    return Hook(hook)


def _hook_router(spec: Spec, onset: int, module, stream) -> Hook:
    def hook(step, batch, lr):
        if step == onset:
            params, opt = module.save_arrays()
            params = {k: (v * 30.0 if k in _router_names(params) else v) for k, v in params.items()}
            module.load_arrays(params, opt, "fault: router weights x30")
        return batch, lr
    return Hook(hook)


def _hook_nan(spec: Spec, onset: int, module, stream) -> Hook:
    def hook(step, batch, lr):
        return batch, (float("nan") if step == onset else lr)
    return Hook(hook)


def _back(spec: Spec) -> int:
    return max(1, round(0.10 * spec.total_steps))


def _hook_stale(spec: Spec, onset: int, module, stream) -> Hook:
    saved: dict[str, Any] = {}

    def hook(step, batch, lr):
        if step == 0:  # copies: a module may hand out views of its live tensors
            params, opt = module.save_arrays()
            saved["state"] = ({k: np.array(v, copy=True) for k, v in params.items()},
                              {k: np.array(v, copy=True) for k, v in opt.items()})
        if step == onset and "state" in saved:
            params, opt = saved.pop("state")
            module.load_arrays(params, opt, f"fault: the initial state at step {onset}")
        return batch, lr
    return Hook(hook)


def _hook_replay(spec: Spec, onset: int, module, stream) -> Hook:
    back = min(_back(spec), onset)  # never before step 0

    def hook(step, batch, lr):
        return (stream.batch(step - back) if step >= onset else batch), lr
    return Hook(hook)


def _hook_slow(spec: Spec, onset: int, module, stream) -> Hook:
    times: list[float] = []
    last = [time.perf_counter()]

    def hook(step, batch, lr):
        now = time.perf_counter()
        if step < onset:
            times.append(now - last[0])
        elif times:
            time.sleep(9.0 * float(np.median(times[1:] or times)))
        last[0] = time.perf_counter()
        return batch, lr
    return Hook(hook)


def _mixture_switch(spec: Spec, onset: int) -> dict[str, Any]:
    src = spec.data.sources
    small = min(src, key=lambda s: s.weight)
    weights = {s.name: (1.0 if s.name == small.name else 0.0) for s in src}
    return {"data.phases": [{"name": "fault_switch", "start_frac": onset / spec.total_steps, "weights": weights}]}


FAULTS: tuple[Fault, ...] = (
    Fault("lr_x4", "peak LR x4 (spec)", spec_change=lambda s, o: {"optim.peak_lr": s.optim.peak_lr * 4},
          from_start=True, critical=True),
    Fault("lr_x0.25", "peak LR x0.25 (spec)", spec_change=lambda s, o: {"optim.peak_lr": s.optim.peak_lr / 4},
          from_start=True),
    Fault("no_warmup", "warmup removed (spec)", spec_change=lambda s, o: {"schedule.warmup_steps": 0}, from_start=True),
    Fault("clip_off_lr_spike", "grad clipping off and LR x30 for 5 steps, from the onset (hook)",
          hook=_hook_lr_spike, gross=True, critical=True),
    Fault("mixture_switch", "mixture switched to its smallest source alone (spec phase)", spec_change=_mixture_switch,
          gross=True, critical=True),
    Fault("small_source_looped", "the same 2 batches over and over (hook)", hook=_hook_looped),
    Fault("corrupted_batch", "one batch of uniform random tokens (hook)", hook=_hook_corrupt, gross=True),
    Fault("router_collapse", "router weights x30 (hook)", hook=_hook_router),
    Fault("nan", "LR NaN for one step (hook)", hook=_hook_nan, gross=True, critical=True),
    Fault("resume_wrong_step", "resumed from step 0's state at the onset step (hook)", hook=_hook_stale, gross=True),
    Fault("replayed_tokens", "the batches of 10% of training earlier again (hook)", hook=_hook_replay),
    Fault("throughput_drop", "each step waits 9x the median step time: a tenth of the rate (hook)", hook=_hook_slow),
)


# ---- running ---------------------------------------------------------------------------------


def step_module(spec: Spec):
    """The engine's own step module for this spec (torch: TorchStep on its default device; JAX:
    the engine's step_module), as the engine's train() would build it."""
    engine = get_engine(spec.engine)
    make = getattr(engine, "step_module", None)
    if make is not None:
        return make(spec)
    device, options = default_device(), EngineOptions.for_spec(spec)
    threads = cpu_threads(spec, options)
    if device.type != "cuda" and threads:
        torch.set_num_threads(threads)
    return TorchStep(spec, device, options)


def reusable(spec: Spec, run_dir: Path, stop: int, what: str) -> str | None:
    """The state of an earlier run in run_dir of this very spec and fault that reached `stop` (or
    diverged on the way), else None."""
    try:
        if load_spec(run_dir / "spec.yaml").id != spec.id or (run_dir / "fault.txt").read_text() != what:
            return None
        status = RunDir(run_dir).read_status()
    except (OSError, ValueError):
        return None
    if status.get("state") == "diverged":
        return "diverged"
    return ("finished" if stop >= spec.total_steps else "stopped") if status.get("step") == stop else None


def train_run(spec: Spec, run_dir: Path, stop: int, hook=None, what: str = "healthy", reuse: bool = False) -> str:
    """Train `spec` in `run_dir` up to step `stop` (a fresh start); 'stopped', 'diverged' or
    'finished'. hook(module, stream): the fault's Trainer callback, given the step module and
    token stream the Trainer trains with. reuse: keep an earlier run of the same spec and fault
    that got as far (to judge a changed monitor on the same runs)."""
    state = reusable(spec, run_dir, stop, what) if reuse else None
    if state is not None:
        return state
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    save_spec(spec, run_dir / "spec.yaml")
    (run_dir / "fault.txt").write_text(what)
    module = step_module(spec)
    stream = TokenStream.from_spec(spec) if hook is not None else None  # (None: the Trainer opens the spec's)
    callbacks = [hook(module, stream)] if hook is not None else []
    trainer = Trainer(spec, run_dir, module, stop_after=stop, stream=stream, callbacks=callbacks)
    try:
        for _ in trainer.fit(resume=False):
            pass
    except DivergedError:
        return "diverged"
    return "finished" if stop >= spec.total_steps else "stopped"


def replay(df: pd.DataFrame, spec: Spec, forecast: Forecast | None, cal: Calibration | None,
           settings: MonitorSettings, status: dict | None, every: int) -> dict[str, Any]:
    """The monitor on the records as they grew: for each flag kind the first prefix end (step)
    at which it was raised at each severity; and the final report. The prefixes end every `every`
    steps and, with a calibration, at the last step of each of its blocks (where `--follow` first
    sees a block complete), so a block's alarm is seen at the step it is raised, not at the next
    round `every`."""
    seen: dict[str, dict[str, int]] = {}
    steps = df["step"].to_numpy()
    last_step = int(steps[-1])
    grid = set(range(every - 1, last_step + 1, every)) | {last_step}
    if cal is not None:
        grid |= {int(e) - 1 for e in cal.edges_array[1:] if 0 < int(e) - 1 <= last_step}
    ends = sorted(grid)
    report = None
    for end in ends:
        part = df[df["step"] <= end]
        if len(part) < 2:
            continue
        last = end == ends[-1]
        report = monitor(part, spec, forecast, settings, status=status if last else None, calibration=cal,
                         plan_tokens_per_s=None)
        for f in report.flags:
            d = seen.setdefault(f.kind, {})
            d.setdefault(f.severity, end)
    return {"seen": seen, "report": report}


def _row(name: str, role: str, fault: Fault | None, spec: Spec, onset: int | None, state: str,
         rep: dict[str, Any]) -> dict[str, Any]:
    total = spec.total_steps
    seen = rep["seen"]
    report = rep["report"]
    loud = [(steps_by_sev[s], kind, s) for kind, steps_by_sev in seen.items() for s in steps_by_sev
            if SEVERITY_RANK[s] >= 1]
    first = min(loud) if loud else None
    crit = min((x for x in loud if x[2] == "critical"), default=None)
    row: dict[str, Any] = {
        "run": name, "role": role, "what": fault.what if fault else f"seed {spec.seed}", "state": state,
        "onset_step": onset, "total_steps": total,
        "first_flag_step": first[0] if first else None, "first_flag": first[1] if first else None,
        "first_flag_severity": first[2] if first else None,
        "first_critical_step": crit[0] if crit else None, "first_critical": crit[1] if crit else None,
        "worst": report.worst if report else None,
        "flags": [{"kind": f.kind, "severity": f.severity, "step": f.first_step,
                   "first_seen": {s: seen.get(f.kind, {}).get(s) for s in seen.get(f.kind, {})},
                   "text": f.evidence.get("text", "")} for f in (report.flags if report else [])],
    }
    if role == "fault" and onset is not None:
        row["delay_frac"] = ((first[0] - onset) / total) if first else None
        limit = 0.02 if fault.gross else 0.10
        row["within"] = limit
        ok = first is not None and first[0] >= onset and (first[0] - onset) / total <= limit + 1e-12
        if fault.critical:
            ok = ok and crit is not None and (crit[0] - onset) / total <= limit + 1e-12
        row["pass"] = bool(ok)
        row["needs_critical"] = fault.critical
    else:
        row["pass"] = first is None
    return row


REPO = Path(__file__).resolve().parents[1]
SOLO = ("throughput_drop",)  # its flag is the step rate: never trained beside other runs
RATE_FLAGS = ("throughput_drop", "throughput_low")


def train_parallel(hero_args: list[str], out: Path, names: list[str], stop_frac: float, onset_frac: float, jobs: int,
                   log=print) -> None:
    """Train the faults `names` `jobs` at a time, each in its own `bench/faults.py --train-only`
    subprocess (their output under OUT/logs)."""
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    queue, running = list(names), []
    while queue or running:
        while queue and len(running) < jobs:
            name = queue.pop(0)
            cmd = [sys.executable, "-m", "bench.faults", *hero_args, "--train-only", "--only", name, "--stop", str(stop_frac),
                   "--onset", str(onset_frac), "--out", str(out), "--reuse"]
            with open(logs / f"{name}.log", "wb") as log_file:
                proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)
            running.append((name, proc, time.time()))
        time.sleep(1.0)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            log(f"{item[0]}: trained (exit {item[1].returncode}) in {time.time() - item[2]:.0f} s, {jobs} at a time")


def _shared_log(out: Path, name: str) -> bool:
    """Whether the fault `name` was trained by a --jobs subprocess (its log under OUT/logs)."""
    return (Path(out) / "logs" / f"{name}.log").exists()


def _recorded_state(run_dir: Path) -> str:
    """A fault run's state as its status.json recorded it (judge-only)."""
    try:
        st = RunDir(run_dir).read_status()
    except (OSError, ValueError):
        return "missing"
    state = str(st.get("state", "unknown"))
    if st.get("error"):
        state += ": " + str(st["error"]).splitlines()[0][:120]
    return state


def train_faults_only(hero: Spec, out: Path, only: tuple[str, ...], stop_frac: float, onset_frac: float,
                      reuse: bool) -> None:
    """Train the faults `only` under OUT/runs without judging them (a --jobs subprocess)."""
    total = hero.total_steps
    stop = max(2, min(total, round(stop_frac * total)))
    onset = max(1, round(onset_frac * total))
    for f in [f for f in FAULTS if f.name in only]:
        at = 0 if f.from_start else onset
        spec = hero.replace(**f.spec_change(hero, at)) if f.spec_change else hero
        hook = functools.partial(f.hook, spec, at) if f.hook else None
        t0 = time.time()
        state = train_run(spec, Path(out) / "runs" / f.name, stop, hook, what=f"{f.name} from step {at}", reuse=reuse)
        print(f"{f.name}: {state} in {time.time() - t0:.0f} s", flush=True)


def _without_rate_flags(rep: dict) -> None:
    """A replay whose step rate was its neighbours' (a shared device or machine): its throughput
    flags are not counted."""
    rep["seen"] = {k: v for k, v in rep["seen"].items() if k not in RATE_FLAGS}


def run_suite(hero: Spec, out: Path, *, forecast: Forecast | None = None, seeds: tuple[int, ...] = (1, 2, 3, 4),
              stop_frac: float = 0.4, onset_frac: float = 0.2, only: tuple[str, ...] = (),
              settings: MonitorSettings | None = None, n_blocks: int = 100, log=print, faults: bool = True,
              reuse: bool = False, healthy_runs: tuple[Path, ...] = (), jobs: int = 1,
              hero_args: list[str] | None = None, judge_only: bool = False,
              shared_machine: bool = False) -> dict[str, Any]:
    """Train the replicates and the faults under `out`, calibrate, judge, write the table.
    healthy_runs: run directories of healthy replicates trained elsewhere (used instead of `seeds`);
    jobs > 1: the faults trained that many at a time in subprocesses (`hero_args`: how their command
    line names the hero, [experiment file] or ["--tiny"]), their throughput flags not counted.
    judge_only: train nothing; judge the fault runs under OUT/runs as they are (runs trained on
    another machine), each run's state read from its status.json. shared_machine: every run trains
    beside other work, so its step rate is not its own: no run's throughput flags are counted."""
    settings = settings or MonitorSettings()
    out = Path(out)
    runs_dir = out / "runs"
    total = hero.total_steps
    stop = max(2, min(total, round(stop_frac * total)))
    onset = max(1, round(onset_frac * total))
    if onset >= stop:
        raise ValueError(f"--onset ({onset_frac}) must come before --stop ({stop_frac})")
    every = max(1, total // 100)
    unknown = set(only) - {f.name for f in FAULTS}
    if unknown:
        raise ValueError(f"unknown fault(s) {sorted(unknown)}; the suite has {[f.name for f in FAULTS]}")
    chosen = [f for f in FAULTS if faults and (not only or f.name in only)]
    if shared_machine and any(f.name in SOLO for f in chosen):
        raise ValueError(f"{', '.join(SOLO)} is flagged by the step rate, which a shared machine does not "
                         "measure: leave it out (--only) or train on a machine of its own")
    healthy: list[tuple[str, pd.DataFrame, Spec, str]] = []
    for d in healthy_runs:
        d = Path(d)
        spec = load_spec(d / "spec.yaml")
        if spec.replace(seed=hero.seed, name=hero.name).id != hero.id:
            raise ValueError(f"{d}: not a replicate of {hero.name} ({hero.id}): its spec differs beyond the seed")
        state = RunDir(d).read_status().get("state", "unknown")
        log(f"healthy replicate {d.name}: {state}, seed {spec.seed}")
        healthy.append((f"healthy_seed{spec.seed}", read_metrics_frame(d), spec, state))
    status_dirs = {f"healthy_seed{load_spec(Path(d) / 'spec.yaml').seed}": Path(d) for d in healthy_runs}
    for seed in () if healthy_runs else seeds:
        spec = hero.replace(seed=seed)
        name = f"healthy_seed{seed}"
        t0 = time.time()
        state = train_run(spec, runs_dir / name, stop, reuse=reuse)
        log(f"{name}: {state} at step {stop} in {time.time() - t0:.0f} s")
        healthy.append((name, read_metrics_frame(runs_dir / name), spec, state))
    if len(healthy) < 2:
        raise ValueError("the suite needs at least 2 healthy seeds (--seeds): their spread is the monitor's band")
    def cal_from(runs):
        return calibrate(runs, total, forecast, n_blocks=n_blocks, spike_window=settings.spike_local_window,
                         spike_min_history=settings.spike_min_history, spike_sigma=settings.spike_sigma,
                         throughput_points=settings.throughput_points)

    cal_all = cal_from([(n, df, s) for n, df, s, _ in healthy])
    cal_all.save(out / "calibration.json")
    rows = []
    for i, (name, df, spec, state) in enumerate(healthy):
        others = [(n, d, s) for j, (n, d, s, _) in enumerate(healthy) if j != i]
        cal = cal_from(others) \
            if len(others) >= 2 else None
        rep = replay(df, spec, forecast, cal, settings, RunDir(status_dirs.get(name, runs_dir / name)).read_status(), every)
        if shared_machine:
            _without_rate_flags(rep)
        rows.append(_row(name, "healthy", None, spec, None, state, rep))
    shared = [f.name for f in chosen if f.name not in SOLO] if jobs > 1 else []
    if judge_only:
        shared = [n for n in (shared or [f.name for f in chosen if f.name not in SOLO])
                  if (runs_dir / n / "fault.txt").exists() and _shared_log(out, n)]
    elif shared:
        if not hero_args:
            raise ValueError("--jobs needs the hero's experiment file (its faults train in subprocesses)")
        train_parallel(hero_args, out, shared, stop_frac, onset_frac, jobs, log)
        reuse = True
    for f in chosen:
        at = 0 if f.from_start else onset
        spec = hero.replace(**f.spec_change(hero, at)) if f.spec_change else hero
        hook = functools.partial(f.hook, spec, at) if f.hook else None
        t0 = time.time()
        try:
            if judge_only or f.name in shared:  # trained already (a subprocess that crashed is not retrained here)
                state = _recorded_state(runs_dir / f.name)
            else:
                state = train_run(spec, runs_dir / f.name, stop, hook, what=f"{f.name} from step {at}", reuse=reuse)
        except Exception as err:  # a fault that breaks the engine outright is also a detection
            state = f"failed: {type(err).__name__}: {err}"
        log(f"{f.name}: {state} in {time.time() - t0:.0f} s")
        try:
            df = read_metrics_frame(runs_dir / f.name)
        except ValueError:
            rows.append({"run": f.name, "role": "fault", "what": f.what, "state": state, "onset_step": at,
                         "total_steps": total, "first_flag_step": None, "pass": False, "flags": []})
            continue
        rep = replay(df, spec, forecast, cal_all, settings, RunDir(runs_dir / f.name).read_status(), every)
        if f.name in shared or shared_machine:
            _without_rate_flags(rep)
        rows.append(_row(f.name, "fault", f, spec, at, state, rep))
        if f.name in shared:
            rows[-1]["shared_device"] = True
    result = {"hero": hero.name, "spec_id": hero.id, "total_steps": total, "stop_step": stop, "onset_step": onset,
              "shared_device": shared, "shared_machine": shared_machine, "healthy_runs": [str(d) for d in healthy_runs],
              "seeds": list(seeds), "forecast": forecast.path if forecast else None,
              "calibration": str(out / "calibration.json"), "false_alarm_rate": settings.false_alarm_rate,
              "rows": rows, "command": " ".join(sys.argv)}
    atomic_write_text(out / "faults.json", json.dumps(result, indent=1, default=str) + "\n")
    atomic_write_text(out / "faults.md", markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    total = result["total_steps"]
    lines = [f"# Fault suite: {result['hero']} ({result['spec_id']}), {total} steps, runs to step {result['stop_step']}",
             "", f"forecast: {result['forecast'] or 'none (reference: the healthy replicates mean)'}; calibration: "
             f"{result['calibration']}; stated false-alarm rate {result['false_alarm_rate']:g} a run (split over the series "
             "and directions the monitor tests)", "",
             "| fault | onset | first flagged | flag | severity | delay (share of training) | first critical | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["role"] != "fault":
            continue
        d = r.get("delay_frac")
        lines.append(f"| {r['run']} | {r['onset_step']} | {r['first_flag_step'] if r['first_flag_step'] is not None else '-'} "
                     f"| {r.get('first_flag') or '-'} | {r.get('first_flag_severity') or '-'} "
                     f"| {f'{d:.1%}' if d is not None else 'missed'} "
                     f"| {r.get('first_critical_step') if r.get('first_critical_step') is not None else '-'} "
                     f"| {'yes' if r['pass'] else 'NO'} |")
    if result.get("shared_device"):
        lines += ["", f"Trained {len(result['shared_device'])} faults a few at a time on one device "
                  f"({', '.join(result['shared_device'])}): their throughput flags are not counted; "
                  f"{', '.join(SOLO)} trained alone."]
    if result.get("shared_machine"):
        lines += ["", "Trained beside other work on a shared machine: no run's throughput flags are counted."]
    lines += ["", "| healthy replicate | warnings or criticals | info flags |", "|---|---|---|"]
    for r in result["rows"]:
        if r["role"] != "healthy":
            continue
        loud = [f"{f['kind']} ({f['severity']}) @{f['step']}" for f in r["flags"] if f["severity"] != "info"]
        info = [f"{f['kind']} @{f['step']}" for f in r["flags"] if f["severity"] == "info"]
        lines.append(f"| {r['run']} | {', '.join(loud) or 'none'} | {', '.join(info) or 'none'} |")
    lines += ["", f"command: `{result['command']}`", ""]
    return "\n".join(lines)


def tiny_hero() -> Spec:
    """The CI scale: a few-thousand-parameter MoE (ladder.presets.micro_spec) on real text, 300
    steps of 8 x 64 tokens, evaluated every 10 steps."""
    return micro_spec("hero-tiny", **{"role": "hero", "data.seq_len": 64, "data.batch_size": 8,
                                      "data.total_tokens": 64 * 8 * 300, "run.eval_every": 10,
                                      "run.eval_batches": 2, "run.checkpoint_every": 1000})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", nargs="?", help="experiment file whose hero the suite runs (or --tiny)")
    p.add_argument("--tiny", action="store_true", help="the CI scale's tiny hero instead of an experiment's")
    p.add_argument("--forecast", default=None)
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--stop", type=float, default=0.4)
    p.add_argument("--onset", type=float, default=0.2)
    p.add_argument("--only", nargs="*", default=[], help="these faults only (default: all)")
    p.add_argument("--no-faults", action="store_true", help="the healthy replicates and the calibration only")
    p.add_argument("--reuse", action="store_true", help="judge the runs already under OUT/runs (same spec, fault "
                   "and stop) again instead of training them: a changed monitor measured on the same runs")
    p.add_argument("--out", default="faults")
    p.add_argument("--healthy-runs", nargs="*", default=[], help="run directories of healthy replicates trained "
                   "elsewhere (full runs at other seeds): judged and used for the calibration, nothing trained for them")
    p.add_argument("--jobs", type=int, default=1, help="train the faults N at a time in subprocesses (their "
                   "throughput flags then do not count; throughput_drop trains alone)")
    p.add_argument("--shared-machine", action="store_true", help="the suite trains beside other work: no run's "
                   "throughput flags count (throughput_drop is refused)")
    p.add_argument("--train-only", action="store_true", help="train the --only faults under OUT/runs and stop")
    p.add_argument("--judge-only", action="store_true", help="train nothing: judge the fault runs already under "
                   "OUT/runs (trained elsewhere) against the healthy runs")
    a = p.parse_args(argv)
    if a.tiny == bool(a.experiment):
        p.error("give an experiment file or --tiny (one of them)")
    hero = tiny_hero() if a.tiny else load_experiment(a.experiment).hero
    fc = load_forecast(a.forecast) if a.forecast else None
    seeds = tuple(int(s) for s in a.seeds.split(",") if s.strip())
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1 (got {a.jobs})")
    if a.train_only:
        train_faults_only(hero, Path(a.out), tuple(a.only), a.stop, a.onset, a.reuse)
        return 0
    res = run_suite(hero, Path(a.out), forecast=fc, seeds=seeds, stop_frac=a.stop, onset_frac=a.onset, only=tuple(a.only),
                    faults=not a.no_faults, reuse=a.reuse, healthy_runs=tuple(Path(d) for d in a.healthy_runs),
                    jobs=a.jobs, hero_args=["--tiny"] if a.tiny else [a.experiment], judge_only=a.judge_only,
                    shared_machine=a.shared_machine)
    print(markdown(res))
    return 0 if all(r["pass"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
