"""The dropless experts' row moves in JAX at the bench shape, each in two forms: XLA's gather of
16-bit elements, and fast.take_rows (the rows as 32-bit words). Times each compiled function
alone (median of three runs of --iters calls) and checks that both forms agree bitwise.

    PYTHONPATH=. python3 bench/jax_gather.py --out $OUT/gather     # 16,384 tokens, top-8 of 64, L 1,024
    PYTHONPATH=. python3 bench/jax_gather.py --tiny                # small shape (CPU)

The moves, per layer (A = T*K assignments sorted by expert, order_A the sort, inv_A its inverse):
    dispatch      x_TL[order_A // K]                          -> x_AL (bf16)
    dispatch_bwd  sum_k g_AL[inv_A] over the K slots, fp32    -> g_TL
    combine       sum_k gate * y_AL[inv_A], fp32              -> y_TL
    combine_bwd   g_TL[order_A // K] * gate, to bf16          -> dy_AL   (g_TL fp32; the take_rows
                  form rounds g_TL to bf16 before the gather: one more rounding, not bitwise)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels_h200 import jax_time_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from engines.jax import fast

    T, L, E, K = (256, 64, 8, 2) if args.tiny else (args.tokens, args.width, args.experts, args.top_k)
    ks = jax.random.split(jax.random.key(0), 5)
    expert_A = jax.random.randint(ks[0], (T * K,), 0, E)
    order_A = jnp.argsort(expert_A, stable=True)
    inv_A = fast.inverse_permutation(order_A)
    src_A = order_A // K
    gate_TK = jax.random.uniform(ks[1], (T, K))
    gate_A = gate_TK.reshape(-1)[order_A]
    x_TL = jax.random.normal(ks[2], (T, L), jnp.bfloat16)
    y_AL = jax.random.normal(ks[3], (T * K, L), jnp.bfloat16)
    g_TL = jax.random.normal(ks[4], (T, L), jnp.float32)
    bf = jnp.bfloat16

    def by_token(rows_AL):
        return rows_AL.reshape(T, K, L).astype(jnp.float32)

    cases = {
        "dispatch": ((x_TL,), lambda x: x[src_A], lambda x: fast.take_rows(x, src_A)),
        "dispatch_bwd": ((y_AL,), lambda g: jnp.sum(by_token(g[inv_A]), 1),
                         lambda g: jnp.sum(by_token(fast.take_rows(g, inv_A)), 1)),
        "combine": ((y_AL,), lambda y: jnp.sum(by_token(y[inv_A]) * gate_TK[..., None], 1),
                    lambda y: jnp.sum(by_token(fast.take_rows(y, inv_A)) * gate_TK[..., None], 1)),
        "combine_bwd": ((g_TL,), lambda g: (g[src_A] * gate_A[:, None]).astype(bf),
                        lambda g: (fast.take_rows(g.astype(bf), src_A).astype(jnp.float32) * gate_A[:, None]).astype(bf)),
    }

    results = {}
    for name, (ops, native, wide) in cases.items():
        f_native, f_wide = jax.jit(native), jax.jit(wide)
        a, b = np.asarray(f_native(*ops).astype(jnp.float32)), np.asarray(f_wide(*ops).astype(jnp.float32))
        same = bool(np.array_equal(a, b))
        rel = float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))
        results[name] = {"native_ms": jax_time_ms(f_native, ops, args.iters), "take_rows_ms": jax_time_ms(f_wide, ops, args.iters),
                         "bitwise_equal": same, "max_rel_diff": rel}
        print(f"{name}: {results[name]}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jax_gather.json").write_text(json.dumps({"shape": {"T": T, "L": L, "E": E, "K": K},
                                                     "device": str(jax.devices()[0]), "moves": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
