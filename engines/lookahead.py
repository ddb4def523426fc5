"""The step loop of engines/trainer.py, with each step's metrics read one step late.

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
