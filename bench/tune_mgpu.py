"""Tile configurations of JAX's Mosaic-GPU ragged dot kernels, per matmul of the dropless experts,
at a shape given by the flags; by default the bench's OLMoE-like one (bench/engines_h200.py:
16,384 tokens top-8 over 64 experts, d_model 1,024, expert hidden 512, gate|up as one
[E, 1024, 1024] matmul).

    PYTHONPATH=. python3 bench/tune_mgpu.py --ops gu_fwd,gu_dx,gu_dw --out $OUT/tune0
    PYTHONPATH=. python3 bench/tune_mgpu.py --d-model 2048 --expert-hidden 1024 --out $OUT/mine   # your widths
    PYTHONPATH=. python3 bench/tune_mgpu.py --tiny                     # two configs, small shape

The six matmuls of one layer (A = 131,072 sorted rows, L = 1,024, F = 512):

    gu_fwd   x_AL @ w_EL2F                     (engines/jax/fast.py _rd)
    gu_dx    g_A2F @ w_EL2F^T                  (_rd, transpose_rhs)
    gu_dw    x_e^T g_e per expert -> [E, L, 2F] (_trd)
    dn_fwd   h_AF @ w_EFL;  dn_dx g_AL @ w_EFL^T;  dn_dw -> [E, F, L]

For each it times the kernel alone (median of repeats of `--iters` calls, compiled once) under
every configuration of the grid, checks every configuration's output (its largest difference from
lax.ragged_dot, or from one fp32-accumulated product an expert for the weight gradients, relative
to the output's largest value), and
prints and writes <out>/tune_mgpu.json: each op's time under engines/jax/fast.py's current choice
and under the best configuration found, in TFLOP/s. The winners go to <out>/mgpu_tiles.json, a
tile file the JAX engine reads from $MOE_LADDER_OPTIONS jax_mgpu_tiles (fast.MGPU_TUNED holds the bench
shape's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_h200 import jax_time_ms, routing_sizes  # noqa: E402

OPS = ("gu_fwd", "gu_dx", "gu_dw", "dn_fwd", "dn_dx", "dn_dw")


def grid(tiny: bool):
    if tiny:
        return [dict(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1),
                dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2, grid_block_n=1)]
    out = []
    for bm, bn, mcs, gbn in itertools.product((64, 128, 192), (128, 256), (2, 4, 6), (1, 2, 4, 8)):
        out.append(dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=mcs, grid_block_n=gbn))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=500.0, help="stop sweeping after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a step (batch x sequence)")
    ap.add_argument("--d-model", type=int, default=1024, help="expert input width L")
    ap.add_argument("--expert-hidden", type=int, default=512, help="expert hidden width F")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lax", action="store_true",
                    help="time each op's current tiles against lax.ragged_dot compiled with XLA's cuDNN "
                         "ragged-dot fusion (fwd and dx; no sweep)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from engines.jax import fast

    if args.tiny:
        A, L, F, E, K = 2048, 128, 64, 8, 2
    else:
        K = args.top_k
        A, L, F, E = args.tokens * K, args.d_model, args.expert_hidden, args.experts
    sizes = jnp.asarray(routing_sizes(0, A, E, K))
    key = jax.random.key(0)
    ks = jax.random.split(key, 4)
    x_AL = jax.random.normal(ks[0], (A, L), jnp.bfloat16)
    g_A2F = jax.random.normal(ks[1], (A, 2 * F), jnp.bfloat16)
    h_AF = jax.random.normal(ks[2], (A, F), jnp.bfloat16)
    w_gu = jax.random.normal(ks[3], (E, L, 2 * F), jnp.bfloat16) * 0.03
    w_dn = jax.random.normal(ks[3], (E, F, L), jnp.bfloat16) * 0.03
    g_AL = x_AL
    rd, trd = fast._kernels()
    bounds = [0, *np.cumsum(np.asarray(sizes)).tolist()]

    def per_expert_dw(a, g):  # the weight gradient's reference: one fp32-accumulated product an expert
        return jnp.stack([jnp.dot(a[s:e].T, g[s:e], preferred_element_type=jnp.float32)
                          for s, e in zip(bounds[:-1], bounds[1:])])
    # (kernel, operands, transpose_rhs, flops, the lax form for the check)
    cases = {
        "gu_fwd": ("rd", (x_AL, w_gu), False, 2 * A * L * 2 * F, lambda: lax.ragged_dot(x_AL, w_gu, sizes)),
        "gu_dx": ("rd", (g_A2F, w_gu), True, 2 * A * L * 2 * F,
                  lambda: lax.ragged_dot(g_A2F, jnp.swapaxes(w_gu, 1, 2), sizes)),
        "gu_dw": ("trd", (x_AL, g_A2F), None, 2 * A * L * 2 * F, lambda: per_expert_dw(x_AL, g_A2F)),
        "dn_fwd": ("rd", (h_AF, w_dn), False, 2 * A * F * L, lambda: lax.ragged_dot(h_AF, w_dn, sizes)),
        "dn_dx": ("rd", (g_AL, w_dn), True, 2 * A * F * L,
                  lambda: lax.ragged_dot(g_AL, jnp.swapaxes(w_dn, 1, 2), sizes)),
        "dn_dw": ("trd", (h_AF, g_AL), None, 2 * A * F * L, lambda: per_expert_dw(h_AF, g_AL)),
    }

    def build(op, cfg):
        kind, (a, b), tr, _, _ = cases[op]
        if kind == "rd":
            return jax.jit(lambda a, b: fast._call(rd, a, b, group_sizes=sizes, transpose_rhs=tr, **cfg)), (a, b)
        return jax.jit(lambda a, b: fast._call(trd, a, b, group_sizes=sizes, **cfg)), (a, b)

    def failure(e: Exception, n: int) -> str:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:n]

    def rel_err(out, ref, scale):
        return None if ref is None else float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale

    def time_cfg(op, cfg, ref, scale, flops):
        """One configuration's time and error, or why it failed (shared memory or tiling the
        shape refuses it)."""
        try:
            fn, ops_ = build(op, cfg)
            err = rel_err(fn(*ops_), ref, scale)
            ms = jax_time_ms(fn, ops_, args.iters)
        except Exception as e:
            return {"cfg": cfg, "error": failure(e, 160)}
        return {"cfg": cfg, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}

    def time_lax(op, ref, scale, flops):
        """The op's lax form (the transposed weight included for dx) compiled with XLA's cuDNN
        ragged-dot fusion; whether the compiled module holds a cuDNN call says if the fusion fired
        (else XLA rewrote it to a dense dot over every group)."""
        kind, (a, b), tr, _, _ = cases[op]
        if kind != "rd":
            return {"error": "weight gradients are not a cuDNN ragged-dot fusion"}
        fn = (lambda a, b: lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), sizes)) if tr else \
            (lambda a, b: lax.ragged_dot(a, b, sizes))
        try:
            compiled = jax.jit(fn).lower(a, b).compile(
                compiler_options={"xla_gpu_experimental_use_ragged_dot_fusion": True})
            text = compiled.as_text()
            err = rel_err(compiled(a, b), ref, scale)
            ms = jax_time_ms(compiled, (a, b), args.iters)
        except Exception as e:
            return {"error": failure(e, 300)}
        return {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err, "cudnn": "cudnn" in text.lower()}

    t0 = time.time()
    results = {}
    for op in [o for o in args.ops.split(",") if o]:
        kind, (a, b), tr, flops, lax_form = cases[op]
        key = fast.mgpu_key(op.split("_")[1], a, b, tr)
        current = fast.mgpu_config(key[0], a, b, tr)
        rows = []
        try:  # every config's output is checked against this (lax.ragged_dot, or one product an expert)
            ref = lax_form().astype(jnp.float32)
            scale = float(jnp.max(jnp.abs(ref)))
        except Exception as err:
            print(f"{op}: no reference ({type(err).__name__}); outputs unchecked", flush=True)
            ref = scale = None
        if args.lax:
            results[op] = {"key": list(key), "current": time_cfg(op, current, ref, scale, flops),
                           "lax_cudnn": time_lax(op, ref, scale, flops)}
            print(f"[{time.time() - t0:6.1f}s] {op}: {results[op]}", flush=True)
            continue
        for cfg in [current] + [c for c in grid(args.tiny) if c != current]:
            if time.time() - t0 > args.budget_s:
                print(f"[{time.time() - t0:6.1f}s] budget reached during {op}", flush=True)
                break
            rows.append(time_cfg(op, cfg, ref, scale, flops))
        ok = [r for r in rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        cur = rows[0] if rows and rows[0]["cfg"] == current else None
        results[op] = {"key": list(key), "current": cur, "best": best, "tried": len(rows),
                       "failed": len(rows) - len(ok), "top5": sorted(ok, key=lambda r: r["ms"])[:5]}
        if not ok and rows:
            print(f"{op}: every config failed, e.g. {rows[0]['error']}", flush=True)
        cur_s = f"{cur['ms']:.3f} ms ({cur['tflops']:.0f} TFLOP/s)" if cur and "ms" in cur else "-"
        best_s = (f"{best['ms']:.3f} ms ({best['tflops']:.0f} TFLOP/s, relative error {best['rel_err']}) "
                  f"{best['cfg']}") if best else "-"
        print(f"[{time.time() - t0:6.1f}s] {op}: current {cur_s}; best of {len(ok)} {best_s}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_mgpu.json").write_text(json.dumps(results, indent=1))
    # the winners as a tile file the JAX engine reads from $MOE_LADDER_OPTIONS jax_mgpu_tiles
    tiles = [{"op": r["key"][0], "m": r["key"][1], "n": r["key"][2], "config": r["best"]["cfg"]}
             for r in results.values() if r.get("best") is not None]
    (out / "mgpu_tiles.json").write_text(json.dumps({"tiles": tiles}, indent=1))
    print(f"{len(tiles)} tuned matmuls in {out / 'mgpu_tiles.json'} (MOE_LADDER_OPTIONS=jax_mgpu_tiles=that path)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
