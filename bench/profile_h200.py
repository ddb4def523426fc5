"""Where one torch engine step goes on the GPU: a torch.profiler trace of the engine's train step
(launch_step + queue_update, each step read after the next was launched, as the engine's loop
and bench/engines_h200.py run it) at the bench's OLMoE-like shape.

    PYTHONPATH=. python3 bench/profile_h200.py --out $OUT/profile
    PYTHONPATH=. python3 bench/profile_h200.py --tiny             # a smoke run (the CPU if no GPU)

Prints and writes <out>/profile.md: the wall time per profiled step, the GPU's busy time (sum of
kernel times) and so its idle share, the kernel time per category (grouped GEMM, dense GEMM,
attention, optimizer, Triton-generated elementwise, copies/casts, index/sort, other), the top
kernels by total time, and the longest stretches with the GPU idle with what the host was doing
at their end.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines.data import TokenStream  # noqa: E402

CATEGORIES = (  # first match wins; patterns are searched in lower-cased kernel names
    ("attention", r"flash|fmha|cudnn|sdpa|attn"),
    ("optimizer", r"fused_adam|multi_tensor|adamw|foreach|l2norm|norm_kernel"),
    ("grouped gemm", r"grouped|_gmm|ragged"),
    ("dense gemm", r"gemm|sm90_xmma|cutlass|cublas|nvjet|matmul"),
    ("triton (fused elementwise/norms)", r"^triton_|triton"),
    ("index / sort / scatter", r"index|gather|scatter|sort|radix|cub::|argsort|cumsum|scan"),
    ("copies and casts", r"copy|cast|convert|memcpy|memset|fill"),
    ("reductions / softmax", r"reduce|softmax|logsumexp"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def is_kernel(ev, device_type) -> bool:
    """A device event that is work on the GPU: not a user annotation (record_function ranges such as
    Optimizer.step#... are mirrored onto the GPU timeline and span the kernels they launched)."""
    return ev.device_type == device_type and not getattr(ev, "is_user_annotation", False)


def gap_table(events, device_type, steps: int, top: int, min_us: float = 50.0) -> list[str]:
    """The longest stretches with no kernel running on the GPU (longer than min_us), each with the
    kernels before and after it and the outermost host ops running when it ended (what the host
    was doing while the GPU waited)."""
    kernels = sorted((e for e in events if is_kernel(e, device_type)), key=lambda e: e.time_range.start)
    if not kernels:
        return ["No device events: no GPU gaps to list."]
    host = [e for e in events if e.device_type != device_type and e.cpu_parent is None]
    gaps, busy_until, prev = [], kernels[0].time_range.end, kernels[0]
    small, n_small = 0.0, 0  # kernel-to-kernel gaps up to min_us: launch latency, not host stalls
    for k in kernels[1:]:
        gap = k.time_range.start - busy_until
        if gap > min_us:
            gaps.append((gap, busy_until, prev.name, k.name, k.time_range.start))
        elif gap > 0:
            small, n_small = small + gap, n_small + 1
        if k.time_range.end > busy_until:
            busy_until, prev = k.time_range.end, k
    total = sum(g[0] for g in gaps)
    lines = [f"{len(kernels) / steps:.0f} kernels/step; GPU idle in gaps over {min_us:.0f} us: "
             f"{total / 1e3 / steps:.2f} ms/step in {len(gaps) / steps:.0f} gaps; in shorter gaps between "
             f"kernels: {small / 1e3 / steps:.2f} ms/step in {n_small / steps:.0f}",
             "", "| gap ms | kernel before | kernel after | host ops at the gap's end |", "|---:|---|---|---|"]
    for dur, _, before, after, end in sorted(gaps, reverse=True)[:top]:
        ops = sorted({e.name for e in host if e.time_range.start <= end <= e.time_range.end})
        lines.append(f"| {dur / 1e3:.2f} | `{before[:60]}` | `{after[:60]}` | {', '.join(o[:50] for o in ops[:4])} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--env", default="", help="KEY=VALUE,... set before the engine runs")
    ap.add_argument("--engine", default="torch", choices=("torch", "jax"))
    args = ap.parse_args(argv)
    for kv in filter(None, args.env.split(",")):
        k, v = kv.split("=", 1)
        os.environ[k] = v
    if args.engine == "jax":
        return profile_jax(args)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import engines_h200 as eb

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench/profile_h200.py needs a CUDA GPU (or --tiny)", file=sys.stderr)
        return 2
    if args.tiny:
        eb.BASE_MODEL = {**eb.BASE_MODEL, **eb.TINY_MODEL}
    eb.DEVICE = "cuda" if cuda else "cpu"
    seq, batch = (128, 2) if args.tiny else (4096, 4)
    n = args.warmup + args.steps
    spec = eb.make_spec(n, seq=seq, batch=batch)

    stream = TokenStream.from_spec(spec)
    batches = [stream.batch(i) for i in range(n)]
    launch, read = eb.torch_steps(spec, eb.torch_options(engine={"torch_master": True}))  # as long runs train

    eb.timed_loop(launch, read, batches[: args.warmup], 0, eb.sync)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        eb.timed_loop(launch, read, batches[args.warmup:], 0, eb.sync)
        wall = time.perf_counter() - t0

    kern: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if cuda and is_kernel(ev, torch.autograd.DeviceType.CUDA):
            kern[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            calls[ev.name] += 1
    busy_us = sum(kern.values())
    per_step = 1e3 * wall / args.steps
    lines = [f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}, "
             f"env {args.env or '-'}",
             f"wall {per_step:.1f} ms/step; GPU kernels {busy_us / 1e3 / args.steps:.1f} ms/step "
             f"({busy_us / 1e3 / max(wall * 1e3, 1e-9):.0%} busy)", "",
             "| category | ms/step | share of kernel time |", "|---|---:|---:|"]
    cats: dict[str, float] = defaultdict(float)
    for k, v in kern.items():
        cats[category(k)] += v
    for c, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {c} | {v / 1e3 / args.steps:.2f} | {v / max(busy_us, 1e-9):.1%} |")
    lines += ["", "| kernel | category | calls/step | ms/step |", "|---|---|---:|---:|"]
    for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[: args.top]:
        lines.append(f"| `{k[:150]}` | {category(k)} | {calls[k] / args.steps:.0f} | {v / 1e3 / args.steps:.2f} |")
    lines += ["", *gap_table(prof.events(), torch.autograd.DeviceType.CUDA, args.steps, args.top)]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.md").write_text(text)
    return 0


def _hlo_section(hlo: str, title: str) -> list[str]:
    """The lines of one of an HLO module's header tables (FileNames, FileLocations, ...)."""
    lines = hlo.splitlines()
    try:
        start = lines.index(title) + 1
    except ValueError:
        return []
    out = []
    for line in lines[start:]:
        if not line.strip():
            break
        out.append(line)
    return out


def hlo_sources(hlo: str, under: str = "engines/") -> dict[str, str]:
    """What each fusion and custom call of a compiled XLA module computes, by the name its GPU
    kernel carries in a trace (the instruction's name with '.' as '_'): its output shape, its JAX
    op name and the innermost source line whose file path holds `under`."""
    files = {int(i): f for i, f in (re.match(r'(\d+) "(.*)"$', l).groups() for l in _hlo_section(hlo, "FileNames"))}
    locs, frames = {}, {}
    for line in _hlo_section(hlo, "FileLocations"):
        m = re.match(r"(\d+) \{file_name_id=(\d+) .*?line=(\d+)", line)
        if m:
            locs[int(m[1])] = (files.get(int(m[2]), "?"), int(m[3]))
    for line in _hlo_section(hlo, "StackFrames"):
        m = re.match(r"(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", line)
        if m:
            frames[int(m[1])] = (int(m[2]), int(m[3]))

    def source(frame: int) -> str:
        seen = set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            loc, parent = frames[frame]
            path, line = locs.get(loc, ("?", 0))
            if under in path:
                return f"{path[path.find(under):]}:{line}"
            frame = parent
        return ""

    out = {}
    pat = re.compile(r"\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.+?) (?P<op>fusion|custom-call)\(")
    for line in hlo.splitlines():
        m = pat.match(line)
        if not m:
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        shape = re.sub(r"\{[^}]*\}", "", m["shape"])  # layouts off
        where = source(int(frame[1])) if frame else ""
        what = op_name[1].split("/")[-1] if op_name else m["op"]
        out[m["name"].replace(".", "_")] = " ".join(x for x in (shape, what, where) if x)
    return out


def profile_jax(args) -> int:
    """The JAX engine's jitted step under jax.profiler; GPU kernel times are read back from the
    Perfetto trace it writes (events on the device's stream lines)."""
    import glob
    import gzip
    import json

    import engines_h200 as eb

    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    import jax

    if args.tiny:
        eb.BASE_MODEL = {**eb.BASE_MODEL, **eb.TINY_MODEL}
    seq, batch = (128, 2) if args.tiny else (4096, 4)
    n = args.warmup + args.steps
    spec = eb.make_spec(n, seq=seq, batch=batch, engine="jax")
    stream = TokenStream.from_spec(spec)
    launch, read, sync, close, info = eb.jax_steps(spec, stream.batch(0), eb.jax_options(), keep_hlo=True)
    what = hlo_sources(info["hlo"])
    batches = [stream.batch(i) for i in range(n)]
    eb.timed_loop(launch, read, batches[: args.warmup], 0, sync)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "jax_step.hlo.txt.gz", "wt") as f:  # the compiled step, to look the fusions up in
        f.write(info["hlo"])
    trace_dir = out / "jax_trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t0 = time.perf_counter()
        eb.timed_loop(launch, read, batches[args.warmup:], 0, sync)
        wall = time.perf_counter() - t0
    close()
    files = glob.glob(str(trace_dir / "**" / "perfetto_trace.json.gz"), recursive=True)
    lines = [f"jax {jax.__version__} on {jax.devices()[0].device_kind}", f"wall {1e3 * wall / args.steps:.1f} ms/step"]
    if not files:
        lines.append("no perfetto trace written")
    else:
        ev = json.load(gzip.open(files[0]))
        ev = ev["traceEvents"] if isinstance(ev, dict) else ev
        pname, tname = {}, {}
        for e in ev:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                pname[e["pid"]] = e["args"]["name"]
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                tname[(e["pid"], e["tid"])] = e["args"]["name"]
        by_line: dict = defaultdict(lambda: defaultdict(float))
        for e in ev:
            if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), ""):
                by_line[tname.get((e["pid"], e["tid"]), "?")][e["name"]] += float(e.get("dur", 0))
        for line, kern in sorted(by_line.items(), key=lambda kv: -sum(kv[1].values())):
            tot = sum(kern.values())
            lines += ["", f"### {line}: {tot / 1e3 / args.steps:.1f} ms/step", "",
                      "| op | category | ms/step | output, JAX op, source (jax_step.hlo.txt.gz) |", "|---|---|---:|---|"]
            cats: dict = defaultdict(float)
            for k, v in kern.items():
                cats[category(k)] += v
            lines += [f"| (category) {c} | | {v / 1e3 / args.steps:.2f} | |"
                      for c, v in sorted(cats.items(), key=lambda kv: -kv[1])]
            lines += [f"| `{k[:150]}` | {category(k)} | {v / 1e3 / args.steps:.2f} | {what.get(k, '')[:160]} |"
                      for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[: args.top]]
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "profile_jax.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
