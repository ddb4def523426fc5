"""The trainer harness: the one training loop of every engine.

An engine supplies a step module (what one step is, on its framework and devices); the Trainer
does everything around the steps, the same way for each of them:

    init and resume     the newest intact checkpoint of the run dir (its checksums verified; a
                        damaged one is moved aside and named), checked to belong to this spec
                        (check_same_run), or the initial weights (saved as step_00000000); a
                        continuation (lineage.resume_step) that was never seeded is refused, and so
                        is a run dir whose metrics.jsonl has records but no checkpoint to resume
                        them from (resume=False starts over, keeping the old records aside in
                        metrics.jsonl.<time>.bak)
    the step loop       engines/lookahead.py: step s + 1 is launched before step s is read,
                        except where an eval, a checkpoint or the end needs the state at once
    eval and checkpoint every run.eval_every / run.checkpoint_every updates and at the end; an
                        eval scores the fixed eval set (engines/evalset.py): run.eval_batches
                        groups of each source's windows periodically (a stratified sample of
                        the source, engines/evalset.periodic_windows), every window at the end
                        (the final eval, which laws fit), reported per source and for the base
                        mixture with the same weights in both, each with its standard error
                        (score_eval); eval_loss_periodic is the periodic sample's value at every
                        eval, the final one included (scored there too), so the periodic curve
                        and the final estimate one quantity and the final is marked eval_final;
                        eval_periodic_windows (the sample's windows a source) says which sample
    divergence          a non-finite step is recorded, status.json says "diverged" and the run
                        raises DivergedError; nothing after the last checkpoint is ever saved
    callbacks           `callbacks` (Callback below, OLMo-core style): called in list order before
                        each step is launched (the batch it reads and its LR) and after its
                        record; none in a real run (the fault suite's faults are callbacks)
    status and metrics  status.json (running -> finished | failed | diverged) and metrics.jsonl
                        through core.rundir (MetricsWriter: one record a step, flushed)

The step module interface (StepModule below) is what the torch engine, the JAX engine and the
multi-process step (engines/torch/parallel/step.py) implement. In a multi-process
run every process runs the Trainer with its own module; only the lead (rank 0) writes the run
dir, and `agree` hands every process the lead's decisions (the checkpoint to resume from).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
from pydantic import ValidationError

from core.costs import flops_per_token
from core.rundir import RunDir
from core.schedule import lr_at
from core.spec import Spec
from engines.base import DivergedError, StepMetrics
from engines.checkpoint import (
    CheckpointError,
    load_checkpoint,
    missing_parent_checkpoint,
    newest_intact_checkpoint,
    remove_checkpoints,
    save_checkpoint,
    warn_if_other_data,
)
from engines.data import EVAL_ROWS, TokenStream, max_seq_len
from engines.lookahead import lookahead_steps

# a step's values by name, as StepModule.read returns them
METRIC_KEYS = ("loss", "z_loss", "aux_loss", "router_z_loss", "drop_frac_send", "drop_frac_recv",
               "expert_load_max", "router_entropy", "total_loss")
VALUE_KEYS = METRIC_KEYS + ("grad_norm",)
FINITE_KEYS = ("loss", "total_loss", "grad_norm")  # a step that makes any of these NaN/inf is not applied


def score_eval(plan: list[tuple[str, np.ndarray]], losses: list[float], weights: dict[str, float]) -> dict:
    """Per-source means and standard errors of the eval loss from its batches' mean losses
    (plan: each batch's (source, rows), rows the indices of its windows).

    Every batch is a group of windows of one source (the same groups in every run), so a source's
    mean is the window-weighted mean of its groups and its standard error the spread of the group
    means: se = sqrt(sum n_g^2 (m_g - m)^2 * G / (G - 1)) / sum n_g. The mixture is sum_s w_s m_s over
    the base mixture's weights w (normalised over the sources scored), se = sqrt(sum_s w_s^2 se_s^2).
    Returns {"eval_loss", "eval_loss_se", "eval_loss/<source>", "eval_loss_se/<source>", "eval_windows"}."""
    by: dict[str, list[tuple[int, float]]] = {}
    for (src, rows), v in zip(plan, losses):
        by.setdefault(src, []).append((len(rows), float(v)))
    out: dict = {}
    means, ses = {}, {}
    for src, groups in by.items():
        n = np.asarray([g[0] for g in groups], np.float64)
        m = np.asarray([g[1] for g in groups], np.float64)
        mean = float((n * m).sum() / n.sum())
        G = len(groups)
        se = float(np.sqrt((n**2 * (m - mean) ** 2).sum() * G / (G - 1)) / n.sum()) if G > 1 else float("nan")
        means[src], ses[src] = mean, se
        out[f"eval_loss/{src}"], out[f"eval_loss_se/{src}"] = mean, se
    w = {s: weights.get(s, 0.0) for s in means}
    total = sum(w.values()) or 1.0
    out["eval_loss"] = float(sum(w[s] / total * means[s] for s in means))
    out["eval_loss_se"] = float(np.sqrt(sum((w[s] / total) ** 2 * ses[s] ** 2 for s in means if w[s] > 0)))
    out["eval_windows"] = int(sum(len(rows) for _, rows in plan))
    return out


class RunHistoryError(CheckpointError):
    """A run dir with metrics records but no checkpoint to resume them from."""


def _warn(msg: str) -> None:
    warnings.warn(msg, stacklevel=2)


class StepModule(Protocol):
    """One engine's step, on its framework and devices."""

    engine: str  # the engine name written into status.json and the checkpoints
    devices: int  # devices one step runs on (the MFU's denominator)
    lead: bool  # whether this process writes the run dir
    lookahead: bool  # whether step s + 1 may be launched before step s is read
    synchronous: bool  # a step's time is its launch and read (CPU) rather than the time between reads

    def init_fresh(self) -> None:
        """The initial weights of the spec's seed."""

    def load_arrays(self, params: dict[str, np.ndarray], opt: dict[str, np.ndarray], origin: str) -> None:
        """The state of a checkpoint (engine-neutral arrays); ValueError when they do not fit."""

    def save_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
        """(params, optimizer state) as engine-neutral arrays; None on a process that does not
        write (called on every process: gathering them may be collective)."""

    def batch_part(self, batch_size: int) -> tuple[int, int]:
        """(part, parts): this process reads only the part-th of `parts` contiguous, equal parts
        of a step's batch of `batch_size` sequences (ValueError if it cannot be split so).
        Optional: a module without it reads the whole batch."""

    def launch(self, step: int, batch_BS1: np.ndarray, lr: float) -> Any:
        """Queue step `step` (forward, backward, update) without waiting for it; batch_BS1 holds
        the rows batch_part names (all of them without it)."""

    def read(self, handle: Any) -> tuple[dict[str, float], bool]:
        """The step's values by VALUE_KEYS and whether it was finite: its one host sync."""

    def eval_losses(self, batches: list[np.ndarray]) -> list[float]:
        """Each eval batch's mean token loss, in order (called on every process with the same
        batches: a multi-process module splits each batch over its ranks itself)."""

    def agree(self, value: Any) -> Any:
        """The lead's `value` on every process (the identity for one process)."""

    def extra(self) -> dict:
        """What this module adds to status.json, the checkpoint info and every record's extra."""

    def describe(self) -> dict:
        """The engine options as they resolved for this run (status.json and the checkpoint
        info: which kernels it used). Optional: a module without it records none."""

    def finish(self, first_step: int, steps: int) -> None:
        """Called on every process after the last step of this launch."""


def check_same_run(spec: Spec, info: dict, path: Path) -> None:
    """A checkpoint continues this spec's run: the same spec id, its lineage parent's, or the
    same spec written by another engine (the id hashes the engine name)."""
    ckpt_id = info.get("spec_id")
    if ckpt_id is None or ckpt_id in (spec.id, spec.lineage.parent_id):
        return
    other = info.get("engine")
    if other and other != spec.engine:
        try:
            if spec.replace(engine=other).id == ckpt_id:
                return
        except ValidationError:  # the spec is not valid under the other engine: the ids cannot match
            pass
    raise CheckpointError(
        f"{path} belongs to spec {ckpt_id}, not this spec ({spec.id}); use another --run-dir, "
        f"--no-resume to start over, or set lineage.parent_id to continue it"
    )


class LearningRates:
    """lr_at(spec, step) computed a block of steps at a time: nothing is allocated in proportion
    to the run's length (a block is computed as a slice of the whole arange would be)."""

    BLOCK = 4096

    def __init__(self, spec: Spec):
        self.spec = spec
        self._block, self._values = -1, np.empty(0)

    def __call__(self, step: int) -> float:
        b = step // self.BLOCK
        if b != self._block:
            lo = b * self.BLOCK
            hi = min(lo + self.BLOCK, self.spec.total_steps)
            self._block, self._values = b, lr_at(self.spec, np.arange(lo, hi))
        return float(self._values[step - b * self.BLOCK])


def record(step: int, tokens: int, lr: float, m: dict[str, float], tps: float, mfu: float, **extra) -> StepMetrics:
    """A step's StepMetrics from its values by name (VALUE_KEYS)."""
    return StepMetrics(
        step=step, tokens=tokens, loss=m["loss"], grad_norm=m["grad_norm"], lr=lr,
        z_loss=m["z_loss"], aux_loss=m["aux_loss"], drop_frac_send=m["drop_frac_send"],
        drop_frac_recv=m["drop_frac_recv"], expert_load_max=m["expert_load_max"],
        router_entropy=m["router_entropy"], tokens_per_s=tps, mfu=mfu, time=time.time(),
        extra={"router_z_loss": m["router_z_loss"], "total_loss": m["total_loss"], **extra},
    )


class Callback:
    """A callback of the Trainer (OLMo-core style): the Trainer calls each one in its list, in
    order, at these points of the loop. Every method's default does nothing, so a callback
    overrides what it uses. A callback changes a run only through what pre_step returns; what
    else it needs (the step module, the token stream) it is handed by whoever builds it, never
    through the Trainer (bench/faults.py builds its faults so)."""

    def pre_step(self, step: int, batch_BS1: np.ndarray, lr: float) -> tuple[np.ndarray, float]:
        """Before step `step` is launched: (the batch it reads, the LR it uses), from those it would
        (the schedule's LR; the rows batch_part names). With lookahead, step s + 1's pre_step may
        come before step s is read."""
        return batch_BS1, lr

    def post_step(self, record: StepMetrics) -> None:
        """After a finite step's record is written (and its eval and checkpoint where due)."""


BATCH_HASH_BITS = 52  # a float64 holds it exactly, so trackers that keep floats only keep it too


def batch_hash(batch_BS1: np.ndarray) -> int:
    """The identity of the tokens a step read (blake2b of the array, 52 bits): two steps that read
    the very same batch have the same hash; recorded as extra.batch_hash, so the monitor can tell
    a run that reads data twice (a replay, a loop, a loader restarted at its start)."""
    digest = hashlib.blake2b(np.ascontiguousarray(batch_BS1).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << BATCH_HASH_BITS) - 1)


class Trainer:
    """Trains `spec` in `run_dir` with `module`'s steps; fit() yields every step's StepMetrics.

    stop_after: end this launch after that step of the schedule (with a checkpoint; the LR
    still follows the whole schedule); checkpoints False: write none (benchmarks); stream: the
    token stream (default: the spec's, engines/data.TokenStream; anything with its batch,
    eval_plan, eval_batch, base_mixture, state and fingerprint); callbacks: Callbacks, called in
    this order (none in a real run)."""

    def __init__(self, spec: Spec, run_dir: str | Path, module: StepModule, stop_after: int | None = None,
                 checkpoints: bool = True, stream: TokenStream | None = None, callbacks: Sequence[Callback] = ()):
        self.spec, self.run, self.module = spec, RunDir(run_dir), module
        total = spec.total_steps
        self.end = total if stop_after is None else min(stop_after, total)
        self.checkpoints = checkpoints
        self.tokens = 0
        self.stream = stream
        self.last_good: tuple[Path, str] | None = None  # the newest checkpoint known good, and how
        self.callbacks = tuple(callbacks)

    # ---- cadence -------------------------------------------------------------------------
    def eval_due(self, done: int) -> bool:
        return done % self.spec.run.eval_every == 0 or done == self.spec.total_steps

    def save_due(self, done: int) -> bool:
        if not self.checkpoints:
            return False
        return done % self.spec.run.checkpoint_every == 0 or done == self.spec.total_steps or done == self.end

    def settles(self, step: int) -> bool:
        """Whether something needs the state right after `step` (0-based): an eval, a checkpoint,
        the end of this launch, or a module that reads every step before the next."""
        done = step + 1
        return not self.module.lookahead or self.eval_due(done) or self.save_due(done) or done == self.end

    # ---- the run -------------------------------------------------------------------------
    def _status(self, state: str, **info) -> None:
        if self.module.lead:
            self.run.write_status(state, engine=self.module.engine, spec_id=self.spec.id, **info,
                                  **self.module.extra(), options=self._options(), eval_set=self._eval_summary())

    def _eval_summary(self) -> dict | None:
        summary = getattr(self.stream, "eval_summary", None)
        return summary() if summary is not None else None

    def _score(self, plan: list[tuple[str, np.ndarray]]) -> dict:
        seq = max_seq_len(self.spec.data)  # windows longer than the model's context are cut to it
        losses = self.module.eval_losses([self.stream.eval_batch(src, rows, seq) for src, rows in plan])
        return score_eval(plan, losses, self.stream.base_mixture())

    def evaluate(self, final: bool) -> dict:
        """Score the fixed eval set: every window when final, else run.eval_batches groups a source
        (its stratified sample); eval_loss_periodic is the sample's value at the final eval too."""
        k = self.spec.run.eval_batches * EVAL_ROWS
        periodic = self.stream.eval_plan(k)
        out = self._score(periodic)
        out["eval_loss_periodic"] = out["eval_loss"]
        if final:
            plan = self.stream.eval_plan(None)
            same = len(plan) == len(periodic) and all(a[0] == b[0] and np.array_equal(a[1], b[1])
                                                      for a, b in zip(plan, periodic))
            out = (dict(out) if same else self._score(plan)) | {"eval_loss_periodic": out["eval_loss"]}
        out["eval_final"] = final
        out["eval_periodic_windows"] = k  # the sample's size a source: periodic levels compare on the same sample
        return out

    def _options(self) -> dict:
        describe = getattr(self.module, "describe", None)
        return describe() if describe is not None else {}

    def _open_stream(self) -> TokenStream:
        # the lead fills the token cache first; the others then read it
        if self.module.lead:
            self.run.path.mkdir(parents=True, exist_ok=True)
        stream = self.stream
        if stream is None and self.module.lead:
            stream = TokenStream.from_spec(self.spec)
        self.module.agree(None)
        if stream is None:
            stream = TokenStream.from_spec(self.spec)
        return stream

    def _set_aside_metrics(self) -> None:
        """A fresh start keeps the records of the run before it as metrics.jsonl.<time>.bak."""
        path = self.run.metrics_path
        if path.exists() and path.stat().st_size > 0:
            aside = path.with_name(f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}.bak")
            path.rename(aside)
            _warn(f"{self.run.path}: starting over (--no-resume); the earlier records are kept in {aside}")

    def _choose(self, resume: bool) -> tuple[str, str]:
        """(the checkpoint to resume from or "", why the run is refused or "") on the lead."""
        spec = self.spec
        if not resume:
            if self.checkpoints:
                self._set_aside_metrics()
                remove_checkpoints(self.run.path)
            return "", ""
        ckpt = newest_intact_checkpoint(self.run.path, warn=_warn)
        if ckpt is not None:
            return str(ckpt), ""
        rows = self.run.read_metrics(warn=None)
        if rows and self.checkpoints and spec.lineage.resume_step is None:
            last = max((r.get("step", -1) for r in rows if isinstance(r.get("step"), int)), default=-1)
            return "", (f"run {spec.name!r} ({self.run.path}) has {len(rows)} metrics records (up to step {last}) "
                        f"but no intact checkpoint to resume them from; restore {self.run.checkpoints}, "
                        f"or start over with --no-resume (the old metrics.jsonl is kept aside as a .bak file)")
        return "", ""

    def _restore(self, resume: bool) -> Path | None:
        """Load the newest intact checkpoint (or the initial weights); returns the checkpoint used."""
        spec, module = self.spec, self.module
        found, refused = module.agree(self._choose(resume) if module.lead else ("", ""))
        if refused:
            raise RunHistoryError(refused)
        ckpt = Path(found) if found else None
        if ckpt is None:
            if spec.lineage.resume_step is not None:
                raise missing_parent_checkpoint(spec, self.run.path)
            module.init_fresh()
            self.start, self.tokens = 0, 0
            return None
        params, opt, info = load_checkpoint(ckpt, verify=False)  # the lead verified it
        how = "its checksums verified as this run resumed from it" if info.get("sha256") else "no checksums recorded"
        self.last_good = (ckpt, how)
        check_same_run(spec, info, ckpt)
        try:
            module.load_arrays(params, opt, str(ckpt))
        except ValueError as err:
            raise CheckpointError(str(err) if str(err).startswith(str(ckpt)) else f"{ckpt}: {err}") from err
        self.start = int(info["step"])
        self.tokens = int(info.get("tokens", self.start * spec.data.tokens_per_step))
        if module.lead:
            warn_if_other_data(ckpt, info, self.stream.fingerprint)
        return ckpt

    def save(self, done: int) -> None:
        """Checkpoint `done` (written by the lead). A checkpoint the lead could not write (no
        space, say) fails every process alike, so none waits for the others at a collective."""
        arrays = self.module.save_arrays()
        failure: CheckpointError | None = None
        if self.module.lead:
            params, opt = arrays
            info = {"tokens": self.tokens, "spec_id": self.spec.id, "spec_name": self.spec.name,
                    "engine": self.module.engine, "data": self.stream.state(done), **self.module.extra(),
                    "options": self._options()}
            try:
                path = save_checkpoint(self.run.path, done, params, opt, info, keep=self.spec.run.keep_checkpoints)
                self.last_good = (path, "written by this run")
            except CheckpointError as err:
                failure = err
        why = self.module.agree(str(failure) if failure is not None else "")
        if failure is not None:
            raise failure
        if why:
            raise CheckpointError(why)

    def fit(self, resume: bool = True) -> Iterator[StepMetrics]:
        spec, module = self.spec, self.module
        self.stream = self._open_stream()
        ckpt = self._restore(resume)
        start = self.start
        self._status("running", step=start)
        if ckpt is None and self.checkpoints:
            self.save(0)  # the initial weights: another engine (or a replan) can start from them
        writer = self.run.metrics_writer(start) if module.lead else None
        lrs = LearningRates(spec)
        t_prev = time.perf_counter()

        batch_part = getattr(module, "batch_part", None)

        def launch(step: int):
            t0 = time.perf_counter()
            if batch_part is None:
                batch = self.stream.batch(step)
                B = batch.shape[0]
            else:
                B = self.stream.batch_size_at(step)
                batch = self.stream.batch(step, *batch_part(B))
            lr = lrs(step)
            for callback in self.callbacks:
                batch, lr = callback.pre_step(step, batch, lr)
            handle = module.launch(step, batch, lr)
            return handle, lr, B * (batch.shape[1] - 1), batch.shape[1] - 1, time.perf_counter() - t0, batch_hash(batch)

        def read(step: int, launched) -> StepMetrics:
            nonlocal t_prev
            handle, lr, n_tok, seq, launch_s, hashed = launched
            t_read = time.perf_counter()
            m, finite = module.read(handle)
            self.tokens += n_tok
            now = time.perf_counter()
            tps = n_tok / max(launch_s + now - t_read if module.synchronous else now - t_prev, 1e-9)
            mfu = float(flops_per_token(spec, seq)) * tps / (spec.hardware.peak_flops * module.devices)
            rec = record(step, self.tokens, lr, m, tps, mfu, **module.extra(), batch_hash=hashed)
            self._close_step(rec, finite, writer)
            for callback in self.callbacks:
                callback.post_step(rec)
            t_prev = time.perf_counter()
            return rec

        try:
            yield from lookahead_steps(start, self.end, launch, read, self.settles)
        except DivergedError:
            raise
        except BaseException as err:  # any end of the steps but divergence (a bug, Ctrl-C): recorded, re-raised
            if not isinstance(err, GeneratorExit):
                self._status("failed", error=f"{type(err).__name__}: {err}")
            raise
        finally:
            if writer is not None:
                writer.close()
        module.finish(start, self.end - start)
        if self.end == spec.total_steps:
            self._status("finished", step=spec.total_steps, tokens=self.tokens)
        else:
            last = self.last_good[0] if self.save_due(self.end) and self.last_good else None
            self._status("running", step=self.end, stopped_at=self.end, last_checkpoint=str(last) if last else None)

    def _close_step(self, rec: StepMetrics, finite: bool, writer) -> None:
        """What follows reading a step: a non-finite step is recorded, marks the run "diverged"
        and raises DivergedError; otherwise the eval where due, the record, and the checkpoint
        where due (in that order: a checkpoint never precedes its step's record)."""
        if not finite:
            last, how = self.last_good or (None, "")
            if writer is not None:
                writer.write(rec)
            self._status("diverged", step=rec.step, loss=rec.loss, grad_norm=rec.grad_norm,
                         last_checkpoint=str(last) if last else None, last_checkpoint_is=how or None)
            where = (f"the newest checkpoint is {last} ({how}); rerun it on purpose with --rerun-diverged"
                     if last else "no checkpoint was written")
            raise DivergedError(f"loss became {rec.loss} (grad norm {rec.grad_norm}) at step {rec.step}; {where}")
        done = rec.step + 1
        if self.eval_due(done):
            scored = self.evaluate(final=done == self.spec.total_steps)
            rec.eval_loss = scored.pop("eval_loss")
            rec.extra.update(scored)
        if writer is not None:
            writer.write(rec)
        if self.save_due(done):
            self.save(done)
