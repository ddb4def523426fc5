"""The kernels the engines' fast paths lean on, timed alone at the bench shape (one MoE layer of
bench/engines_h200.py: 4 x 4,096 tokens, top-8 of 64 experts, d 1,024, expert hidden 512; attention
4 x 16 heads x 4,096 x 64), forward + backward, bf16:

    PYTHONPATH=. python3 bench/kernels_h200.py [--only torch,jax]

torch: torch._grouped_mm with the weights K-major vs N-major; SDPA causal with each backend;
`--only optimizer`: the grad norm and MasterAdamW's kernel (block sizes), in TB/s.
JAX: lax.ragged_dot; the Pallas Mosaic-GPU ragged dot kernels; jax.nn.dot_product_attention
(cuDNN vs XLA). A line per kernel: milliseconds and TFLOP/s (model FLOPs of the operation).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

A, L, F_, E = 4 * 4096 * 8, 1024, 512, 64
B, H, S, Q = 4, 16, 4096, 64
DEV = "cuda"


def _sync():
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def timeit(fn, reps=20):
    """Milliseconds a call of fn, after 3 untimed calls."""
    for _ in range(3):
        fn()
    _sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync()
    return (time.perf_counter() - t) / reps * 1e3


def jax_time_ms(fn, ops, iters=10):
    """Milliseconds a call of the JAX function fn(*ops): the median of three runs of `iters` calls,
    after one untimed call."""
    import jax

    jax.block_until_ready(fn(*ops))
    reps = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*ops)
        jax.block_until_ready(out)
        reps.append((time.perf_counter() - t) / iters * 1e3)
    return sorted(reps)[1]


def routing_sizes(seed=0, n_rows=None, n_experts=None, K=8):
    """Expert sizes of one top-K routing of n_rows / K tokens (default: this bench's A rows over E
    experts, top-8) with mildly skewed router scores."""
    import numpy as np

    n_rows, n_experts = n_rows or A, n_experts or E
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_rows // K, n_experts)) + rng.normal(scale=0.5, size=n_experts)
    top = np.argsort(-logits, axis=1)[:, :K]
    return np.bincount(top.reshape(-1), minlength=n_experts).astype(np.int32)


def report(name, ms, flops):
    print(f"{name:48s} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


def bench_torch():
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    sizes = torch.tensor(routing_sizes(), device=dev)
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    x = torch.randn(A, L, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for layout in ("nmajor", "kmajor"):
        w32 = torch.randn(E, L, F_, device=dev, requires_grad=True)

        def fwd_bwd():
            w = w32.to(torch.bfloat16)
            if layout == "kmajor":
                w = w.transpose(-2, -1).contiguous().transpose(-2, -1)
            y = torch._grouped_mm(x, w, offs=offs)
            y.backward(torch.ones_like(y))

        def fwd():
            w = w32.to(torch.bfloat16)
            if layout == "kmajor":
                w = w.transpose(-2, -1).contiguous().transpose(-2, -1)
            with torch.no_grad():
                torch._grouped_mm(x, w, offs=offs)

        try:
            report(f"torch _grouped_mm fwd {layout}", timeit(fwd), 2 * A * L * F_)
            report(f"torch _grouped_mm fwd+bwd {layout}", timeit(fwd_bwd), 6 * A * L * F_)
        except Exception as err:
            print(f"torch _grouped_mm {layout}: {type(err).__name__}: {err}"[:400], flush=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(B, H, S, Q, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    attn_flops = 4 * B * H * S * S / 2 * Q
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fb():
            with sdpa_kernel(be):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(torch.ones_like(o))

        def f():
            with sdpa_kernel(be), torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        try:
            report(f"torch sdpa causal fwd {name}", timeit(f), attn_flops)
            report(f"torch sdpa causal fwd+bwd {name}", timeit(fb), 3.5 * attn_flops)
        except Exception as err:
            print(f"torch sdpa {name}: {type(err).__name__}: {err}"[:400], flush=True)


DW_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
              (256, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 32, 4, 5), (64, 128, 64, 4, 4)]


def bench_grouped():
    """torch._grouped_mm's three roles apart (forward, input gradient, weight gradient) for both
    expert matmuls of the bench shape, against engines/torch/kernels/grouped_dw.py's weight gradient."""
    import torch

    from engines.torch.kernels import swiglu_gemm as S
    from engines.torch.kernels.grouped_dw import launch_grouped_dw

    dev, bf = DEV, torch.bfloat16
    offs = torch.cumsum(torch.tensor(routing_sizes(), device=dev), 0, dtype=torch.int32)
    for name, K, N in (("gate_up", L, 2 * F_), ("down", F_, L)):
        x = torch.randn(A, K, device=dev, dtype=bf)
        dy = torch.randn(A, N, device=dev, dtype=bf)
        w = torch.randn(E, K, N, device=dev, dtype=bf) / K**0.5
        fl = 2 * A * K * N
        report(f"{name} fwd _grouped_mm", timeit(lambda: torch._grouped_mm(x, w, offs=offs)), fl)
        report(f"{name} dx _grouped_mm", timeit(lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=offs)), fl)
        ref = torch._grouped_mm(x.t(), dy, offs=offs)
        report(f"{name} dw _grouped_mm(x.t(), dy)", timeit(lambda: torch._grouped_mm(x.t(), dy, offs=offs)), fl)
        report(f"{name} dw _grouped_mm(dy.t(), x).mT",
               timeit(lambda: torch._grouped_mm(dy.t(), x, offs=offs)), fl)
        for role, a_in, w_in, out_n in (("fwd", x, w, N), ("dx", dy, w.transpose(-2, -1), K)):
            want = torch._grouped_mm(a_in, w_in, offs=offs)
            for cfg in MM_CONFIGS:
                out = torch.empty(A, out_n, device=dev, dtype=bf)
                try:
                    S.launch_grouped_mm(a_in, w_in, offs, out, cfg)
                    err = (out.float() - want.float()).abs().max().item() / want.float().abs().max().item()
                    report(f"{name} {role} triton {cfg} (rel err {err:.1e})",
                           timeit(lambda: S.launch_grouped_mm(a_in, w_in, offs, out, cfg)), fl)
                except Exception as e:
                    print(f"{name} {role} triton {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)

        def autograd_bwd():
            torch.autograd.grad(torch._grouped_mm(xr, wr, offs=offs), (xr, wr), dy)

        report(f"{name} fwd+bwd autograd", timeit(autograd_bwd), 3 * fl)
        scale = ref.float().abs().max().item()
        for cfg in DW_CONFIGS:
            out = torch.empty(E, K, N, device=dev, dtype=bf)
            try:
                launch_grouped_dw(x, dy, offs, out, cfg)
                err = (out.float() - ref.float()).abs().max().item() / scale
                report(f"{name} dw triton {cfg} (rel err {err:.1e})",
                       timeit(lambda: launch_grouped_dw(x, dy, offs, out, cfg)), fl)
            except Exception as e:
                print(f"{name} dw triton {cfg}: {type(e).__name__}: {e}"[:300], flush=True)


MM_CONFIGS = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)]
SWIGLU_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4),
                  (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


def bench_swiglu():
    """The experts' SwiGLU in the grouped matmuls' epilogues (engines/torch/kernels/swiglu_gemm.py) against
    _grouped_mm followed by Inductor's elementwise kernel: the up matmul + SwiGLU forward, and
    the down matmul's input gradient + SwiGLU backward, at the bench shape."""
    import torch
    import torch.nn.functional as F

    from engines.torch.kernels import swiglu_gemm as S

    dev, bf = DEV, torch.bfloat16
    offs = torch.cumsum(torch.tensor(routing_sizes(), device=dev), 0, dtype=torch.int32)
    x = torch.randn(A, L, device=dev, dtype=bf)
    dy = torch.randn(A, L, device=dev, dtype=bf)
    w_gu = torch.randn(E, L, 2 * F_, device=dev, dtype=bf) / L**0.5
    w_down = torch.randn(E, F_, L, device=dev, dtype=bf) / F_**0.5
    swiglu = torch.compile(lambda gu: F.silu(gu[:, :F_]) * gu[:, F_:])

    def swiglu_bwd(dh, gu):
        g, u = gu[:, :F_].float(), gu[:, F_:].float()
        sig = torch.sigmoid(g)
        return torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], -1).to(gu.dtype)

    swiglu_bwd = torch.compile(swiglu_bwd)
    fl_up, fl_down = 2 * A * L * 2 * F_, 2 * A * L * F_
    report("up + swiglu: _grouped_mm, Inductor", timeit(lambda: swiglu(torch._grouped_mm(x, w_gu, offs=offs))), fl_up)
    gu_ref = torch._grouped_mm(x, w_gu, offs=offs)
    h_ref = swiglu(gu_ref)
    report("down dx + swiglu bwd: _grouped_mm, Inductor",
           timeit(lambda: swiglu_bwd(torch._grouped_mm(dy, w_down.transpose(-2, -1), offs=offs), gu_ref)), fl_down)
    dgu_ref = swiglu_bwd(torch._grouped_mm(dy, w_down.transpose(-2, -1), offs=offs), gu_ref)
    gu, h, dgu = torch.empty_like(gu_ref), torch.empty_like(h_ref), torch.empty_like(gu_ref)
    # the dispatch's gather: the sorted rows read from the tokens' rows (top-8: A / 8 tokens)
    x_T = torch.randn(A // 8, L, device=dev, dtype=bf)
    src = torch.randperm(A, device=dev) // 8
    report("dispatch gather + up + swiglu: index_select, _grouped_mm, Inductor",
           timeit(lambda: swiglu(torch._grouped_mm(x_T.index_select(0, src), w_gu, offs=offs))), fl_up)
    for cfg in SWIGLU_CONFIGS[:3]:
        try:
            S.launch_swiglu_up(x_T, w_gu, offs, gu, h, cfg, idx_A=src)
            report(f"dispatch gather + up + swiglu fused {cfg}",
                   timeit(lambda: S.launch_swiglu_up(x_T, w_gu, offs, gu, h, cfg, idx_A=src)), fl_up)
        except Exception as e:
            print(f"up fused gather {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
    for cfg in SWIGLU_CONFIGS:
        try:
            S.launch_swiglu_up(x, w_gu, offs, gu, h, cfg)
            err = max((gu.float() - gu_ref.float()).abs().max().item(), (h.float() - h_ref.float()).abs().max().item())
            report(f"up + swiglu fused {cfg} (max err {err:.1e})",
                   timeit(lambda: S.launch_swiglu_up(x, w_gu, offs, gu, h, cfg)), fl_up)
        except Exception as e:
            print(f"up fused {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
        try:
            S.launch_swiglu_down_dx(dy, w_down, gu_ref, offs, dgu, cfg)
            err = (dgu.float() - dgu_ref.float()).abs().max().item() / dgu_ref.float().abs().max().item()
            report(f"down dx + swiglu bwd fused {cfg} (rel err {err:.1e})",
                   timeit(lambda: S.launch_swiglu_down_dx(dy, w_down, gu_ref, offs, dgu, cfg)), fl_down)
        except Exception as e:
            print(f"down dx fused {cfg}: {type(e).__name__}: {e}"[:300], flush=True)


def bench_optimizer():
    """The fast path's memory-bound optimizer passes at the bench model's sizes: the grad norm over
    its gradients (49 bf16 working-copy gradients and 39 fp32 ones) as one mixed-dtype
    torch._foreach_norm against master.foreach_norms (one per dtype); and MasterAdamW's kernel
    on one layer's gate|up experts (64 x 1,024 x 1,024) for each block size and warp count, in
    TB/s of its 28 bytes a parameter (20 with bf16 moments)."""
    import torch

    from engines.torch.kernels import adamw_kernel as K
    from engines.torch.master import foreach_norms

    dev, bf, f32 = DEV, torch.bfloat16, torch.float32
    layers, d, V, Fh = (2, 64, 512, 32) if DEV == "cpu" else (12, L, 50304, F_)
    bf_shapes = [(d, 3 * d), (d, d), (E, d, 2 * Fh), (E, Fh, d)] * layers + [(d, V)]
    f32_shapes = [(d,), (d,), (d, E)] * layers + [(V, d), (d,)]
    grads = [torch.randn(s, device=dev, dtype=bf) for s in bf_shapes] + \
            [torch.randn(s, device=dev, dtype=f32) for s in f32_shapes]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    for name, fn in (("grad norm, one mixed-dtype _foreach_norm", lambda: torch._foreach_norm(grads, 2, dtype=f32)),
                     ("grad norm, master.foreach_norms (one per dtype)", lambda: foreach_norms(grads))):
        ms = timeit(fn)
        print(f"{name:58s} {ms:8.3f} ms  {nbytes / ms / 1e9:7.2f} TB/s", flush=True)
    shape = (E, d, 2 * Fh)
    p = torch.randn(shape, device=dev, dtype=f32)
    g = torch.randn(shape, device=dev, dtype=bf)
    w = torch.empty(shape, device=dev, dtype=bf)
    s9 = torch.tensor([1e-3, 1 - 1e-4, 0.1, 0.95, 0.05, 1e-8, 1.0, 1.0, 1.0], device=dev, dtype=f32)
    for mdt, per in ((f32, 28), (bf, 20)):
        m = torch.zeros(shape, device=dev, dtype=mdt)
        v = torch.zeros(shape, device=dev, dtype=mdt)
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
            ms = timeit(lambda: K.adamw_launch(p, g, m, v, w, s9, block, warps))
            print(f"adamw kernel, {str(mdt)[6:]} moments, block {block:5d}, {warps:2d} warps      "
                  f"{ms:8.3f} ms  {p.numel() * per / ms / 1e9:7.2f} TB/s", flush=True)


def bench_jax():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    def timeit(fn, *args, reps=10):
        out = fn(*args)
        jax.block_until_ready(out)
        out = fn(*args)
        jax.block_until_ready(out)
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / reps * 1e3

    key = jax.random.key(0)
    sizes = jnp.asarray(routing_sizes())
    x = jax.random.normal(key, (A, L), jnp.bfloat16)
    w = jax.random.normal(key, (E, L, F_), jnp.bfloat16)

    def loss_lax(x, w):
        return jnp.sum(lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32))

    try:
        report("jax lax.ragged_dot fwd", timeit(jax.jit(lambda x, w: lax.ragged_dot(x, w, sizes)), x, w),
               2 * A * L * F_)
        report("jax lax.ragged_dot fwd+bwd", timeit(jax.jit(jax.grad(loss_lax, argnums=(0, 1))), x, w),
               6 * A * L * F_)
    except Exception as err:
        print(f"jax ragged_dot: {type(err).__name__}: {err}"[:400], flush=True)
    try:
        from engines.jax import fast

        for cfg in fast.MGPU_CONFIGS:
            fast.MGPU.update(cfg)
            fn = jax.jit(lambda x, w: fast.mgpu_gmm(x, w, sizes))
            report(f"jax mgpu ragged_dot fwd {cfg}", timeit(fn, x, w), 2 * A * L * F_)
            g = jax.jit(jax.grad(lambda x, w: jnp.sum(fast.mgpu_gmm(x, w, sizes).astype(jnp.float32)),
                                 argnums=(0, 1)))
            report(f"jax mgpu ragged_dot fwd+bwd {cfg}", timeit(g, x, w), 6 * A * L * F_)
            ref = jax.jit(lambda x, w: lax.ragged_dot(x, w, sizes))(x[:, :], w)
            got = jax.jit(lambda x, w: fast.mgpu_gmm(x, w, sizes))(x, w)
            err = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - got.astype(jnp.float32))))
            print(f"   mgpu vs lax max abs diff {err:.3g} (values ~{float(jnp.std(ref.astype(jnp.float32))):.3g})")
    except Exception as err:
        print(f"jax mgpu: {type(err).__name__}: {err}"[:600], flush=True)
    qkv = [jax.random.normal(jax.random.key(i), (B, S, H, Q), jnp.bfloat16) for i in range(3)]
    attn_flops = 4 * B * H * S * S / 2 * Q
    for impl in ("cudnn", "xla"):
        def f(q, k, v, impl=impl):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        def lf(q, k, v, impl=impl):
            return jnp.sum(f(q, k, v).astype(jnp.float32))

        try:
            report(f"jax dot_product_attention fwd {impl}", timeit(jax.jit(f), *qkv), attn_flops)
            report(f"jax dot_product_attention fwd+bwd {impl}",
                   timeit(jax.jit(jax.grad(lf, argnums=(0, 1, 2))), *qkv), 3.5 * attn_flops)
        except Exception as err:
            print(f"jax attention {impl}: {type(err).__name__}: {err}"[:400], flush=True)
    del np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="torch,jax", help="comma list of: grouped, swiglu, optimizer, torch, jax")
    ap.add_argument("--tiny", action="store_true",
                    help="grouped, swiglu and optimizer at a tiny shape on the CPU (a smoke run; set TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if args.tiny:
        global A, L, F_, E, DEV
        A, L, F_, E, DEV = 1024, 64, 32, 16, "cpu"
    which = set(args.only.split(","))
    if "grouped" in which:
        bench_grouped()
    if "swiglu" in which:
        bench_swiglu()
    if "optimizer" in which:
        bench_optimizer()
    if "torch" in which:
        bench_torch()
    if "jax" in which:
        bench_jax()
    return 0


if __name__ == "__main__":
    sys.exit(main())
