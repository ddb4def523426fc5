"""The engines' step loop with each step's metrics read one step late.

Reading a step's metrics (for its record and its finiteness check) is the step's one host sync.
Read right after the step was queued, it leaves the device idle from the end of that step until
the host has launched the next one (the record, the batch, the launch overhead of the next
forward). Here step s + 1 is launched before step s is read, so the device goes from one step to
the next without waiting. (The read must wait for step s alone: in torch, a copy to the host
queued after step s + 1 would wait for all of it, hence engines/torch/engine.py's HostCopy,
queued as step s ends.)

What makes that safe:
- the update of a step is queued with its finiteness on the device (engines/torch: MasterAdamW
  and GuardedAdamW skip a non-finite step; engines/jax: the step is functional), so the host
  does not have to see step s before it launches step s + 1;
- a step after which something needs the state as step s left it (evaluation, a checkpoint, the
  last step; `settle`) is read before anything else is launched;
- a non-finite step still ends the run with DivergedError at that step's record. The step
  launched behind it is dropped unread, and the checkpoints on disk are the last good ones, as
  without look-ahead.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, TypeVar

R = TypeVar("R")


def lookahead_steps(start: int, total: int, launch: Callable[[int], Any], read: Callable[[int, Any], R],
                    settle: Callable[[int], bool]) -> Iterator[R]:
    """read(s, launch(s)) for s in [start, total), in order, with launch(s + 1) called before
    read(s) unless settle(s) (then read(s) comes first)."""
    pending: tuple[int, Any] | None = None
    for step in range(start, total):
        handle = launch(step)
        if pending is not None:
            yield read(*pending)
            pending = None
        if settle(step):
            yield read(step, handle)
        else:
            pending = (step, handle)
    if pending is not None:
        yield read(*pending)


def _eval_due(spec, done: int) -> bool:
    return done % spec.run.eval_every == 0 or done == spec.total_steps


def _save_due(spec, done: int) -> bool:
    return done % spec.run.checkpoint_every == 0 or done == spec.total_steps


def settles(spec, step: int) -> bool:
    """Whether something needs the state right after `step` (0-based): an eval, a checkpoint or
    the end of the run."""
    return _eval_due(spec, step + 1) or _save_due(spec, step + 1)


def close_step(rec, finite: bool, spec, run_dir, engine: str, writer, evaluate: Callable[[], float],
               save: Callable[[int], None]):
    """What follows reading a step, in either engine: a non-finite step is recorded, marks the run
    "diverged" and raises DivergedError; otherwise the eval where due, the record, and the
    checkpoint where due (in that order: a checkpoint never precedes its step's record)."""
    from engines.base import DivergedError, write_status
    from engines.checkpoint import latest_checkpoint

    if not finite:
        writer.write(rec)
        last = latest_checkpoint(run_dir)
        write_status(run_dir, "diverged", step=rec.step, engine=engine, spec_id=spec.id, loss=rec.loss,
                     grad_norm=rec.grad_norm, last_checkpoint=str(last))
        raise DivergedError(f"loss became {rec.loss} (grad norm {rec.grad_norm}) at step {rec.step}; "
                            f"the last good checkpoint is {last}")
    done = rec.step + 1
    if _eval_due(spec, done):
        rec.eval_loss = evaluate()
    writer.write(rec)
    if _save_due(spec, done):
        save(done)
    return rec


def train_loop(spec, run_dir, engine: str, start: int, launch, read, writer,
               tokens: Callable[[], int]) -> Iterator:
    """lookahead_steps from `start` to the end of the spec, with the run's status kept: "failed"
    (with the error) if anything but a divergence or the consumer's close stops it, "finished"
    (with the tokens seen) at the end; the metrics writer is closed either way."""
    from engines.base import DivergedError, write_status

    try:
        yield from lookahead_steps(start, spec.total_steps, launch, read, lambda s: settles(spec, s))
    except DivergedError:
        raise
    except BaseException as err:
        if not isinstance(err, GeneratorExit):
            write_status(run_dir, "failed", engine=engine, spec_id=spec.id, error=f"{type(err).__name__}: {err}")
        raise
    finally:
        writer.close()
    write_status(run_dir, "finished", step=spec.total_steps, engine=engine, spec_id=spec.id, tokens=tokens())
