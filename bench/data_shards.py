"""Training from memory-mapped shards against training from in-memory arrays, in one process.

Both arms read the same batches of the same TokenStream (a rung of experiments/proxy_cpu.py by
default: the cpu-4k BPE over the Python installation's code and prose); the in-memory arm's
shards are copies of the memmapped parts in RAM. Each step is the batch read plus a real torch
step (forward, backward, AdamW) on the rung's model. The arms alternate in blocks of --block
steps, --rounds times, so machine load hits both alike; the ratio (shards / memory, per-step
median) is the result, and so is the batch read alone.

    .venv/bin/python bench/data_shards.py [--rung d40] [--rounds 6] [--block 10]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.data import TokenStream  # noqa: E402
from engines.options import EngineOptions  # noqa: E402
from engines.shards import ShardSet  # noqa: E402
from ladder.experiment import load_experiment  # noqa: E402


def in_memory(stream):
    mem = copy.copy(stream)
    mem.sources = {n: dataclasses.replace(st, shards=ShardSet(st.shards.name, st.shards.dir, st.shards.index,
                                                              [copy.deepcopy(p.__array__()) for p in st.shards.parts]))
                   for n, st in stream.sources.items()}
    return mem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default="experiments/proxy_cpu.py")
    ap.add_argument("--rung", default="d40")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=10)
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    from engines.torch.step import TorchStep

    torch.set_num_threads(1)
    spec = load_experiment(a.experiment).by_name(a.rung)
    shards = TokenStream.from_spec(spec)
    arms = {"shards": shards, "memory": in_memory(shards)}
    assert np.array_equal(arms["shards"].batch(3), arms["memory"].batch(3))
    engine_step = TorchStep(spec, torch.device("cpu"), EngineOptions.for_spec(spec).replace(cpu_threads=1))
    engine_step.init_fresh()  # the torch engine's own step module

    def step(stream, s):
        t0 = time.perf_counter()
        batch = stream.batch(s)
        t1 = time.perf_counter()
        engine_step.read(engine_step.launch(s, batch, spec.optim.peak_lr))
        return time.perf_counter() - t0, t1 - t0

    times = {k: ([], []) for k in arms}
    s = 0
    for _ in range(2):  # warm-up, untimed
        for st in arms.values():
            step(st, s)
            s += 1
    for r in range(a.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            for _ in range(a.block):
                full, read = step(arms[name], s)
                times[name][0].append(full)
                times[name][1].append(read)
                s += 1
    med = {k: (statistics.median(v[0]), statistics.median(v[1])) for k, v in times.items()}
    n_tokens = sum(st.n_tokens for st in shards.sources.values())
    print(f"{a.experiment} {a.rung}: batch {spec.data.batch_size} x {spec.data.seq_len + 1}, "
          f"{n_tokens:,} tokens in {sum(len(st.shards.parts) for st in shards.sources.values())} shards, "
          f"{a.rounds * a.block} timed steps an arm")
    for k, (full, read) in med.items():
        print(f"  {k:7s} step {full * 1e3:8.2f} ms (median)   batch read {read * 1e6:8.1f} us")
    print(f"ratio shards / memory: step {med['shards'][0] / med['memory'][0]:.3f}, "
          f"batch read {med['shards'][1] / med['memory'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
