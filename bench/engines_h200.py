"""Both engines against the Hugging Face OLMoE trainer, OLMo-core 3 and torchtitan, side by side in
one process on one GPU.

    PYTHONPATH=. python3 bench/engines_h200.py                      # the main table
    PYTHONPATH=. python3 bench/engines_h200.py --only ref,olmo-core,torchtitan,torch,jax --repeat 2
    PYTHONPATH=. python3 bench/engines_h200.py --shape d768 --only torch,torch_cap --profile torch,torch_cap
    PYTHONPATH=. python3 bench/engines_h200.py --scaling            # + 8/128 experts, seq 8192
    PYTHONPATH=. python3 bench/engines_h200.py --only torch,jax --steps 5
    PYTHONPATH=. python3 bench/engines_h200.py --cpu-smoke --only torch,jax --steps 1 --warmup 1
    PYTHONPATH=. python3 bench/engines_h200.py --only torch,torch_mesh --steps 10 --warmup 3

Peers (bench/peers.py; `ai2-olmo-core` 3.0.0 and `torchtitan` 0.3.0 must be importable; CUDA only):
`olmo-core` is OLMo-core 3's MoE (OLMoDDPModel) with its train module and optimizer; it needs
Transformer Engine, and where that is missing its row says so and `olmo-core_v1` (OLMo-core's first
MoE, capacity experts, through its TransformerTrainModule at its OLMoE recipe's settings) runs in
its place; `torchtitan` is torchtitan's Qwen3 MoE with its parallelisation, compile, FlexAttention,
CUDA graph and AdamW. Each runs at its own settings; every peer's exact configuration is written
into its row's info and the table. `--tiny` without a GPU builds the peers on the meta device and
checks their parameter counts against the bench's (a row each, variant `<peer>_meta`).
`--then NAMES` runs more variants at the main shape after the d768 ones (the first cut by
`--budget-s`).

`--shape d768` is Marin's d768 rung (core.rules.moe_model(768, 8): vocab 128,256, 384 experts
top-8 of width 384 inside a latent of 384, 2 shared experts, 8 layers, 6 heads / 1 KV head of 128,
window 2,048), sequence 4,096, batch 8, on one GPU (one expert shard; capacity factors 1.15).
`--profile NAMES` profiles those torch variants for a few more steps after their timed ones and
groups the GPU kernel time by name into attention, experts, router and dispatch, head and loss,
optimizer, dense GEMMs and the rest (<out>/breakdown.md).

The shape (OLMoE-like): vocab 50,304, d_model 1,024, 12 layers, 16 heads x 64 (full MHA), 64 routed
experts top-8 of hidden 512, no shared experts, no latent, sequence 4,096, batch 4, dropless; the
same in capacity mode (factors 1.25, one shard). Every variant trains on the same real-text batches
(engines/data.py) from step 0; warm-up steps (compilation included) are not timed; the timed steps
run back to back between two device synchronisations.

Columns: tokens/s; model TFLOP/s = tokens/s x training FLOPs per token (core.costs.flops_per_token:
6 x (active params incl. router + lm head) + causal attention, cross-checked against an independent
count below); MFU against a large bf16 matmul timed in the same process; peak memory (torch: max
allocated; JAX: the compiled step's planned footprint, arguments + temporaries); the ratio of
tokens/s to the Hugging Face reference; the losses over the timed steps; the engines' tokens/s
over the same timed batches again with each step read before the next is launched (their loop
reads a step after launching the next, engines/lookahead.py; the reference's loop here too).

The engines train through their own step modules (engines/torch/step.TorchStep, the JAX engine's
step_module) and loop (engines/lookahead.py), under EngineOptions built here for each variant (the
engine's defaults with the variant's choices; the environment does not reach them).

`torch_mesh` (and `torch_mesh_cap`) is the `torch` row's model, batches and options trained through
the multi-process layout's step module (engines/torch/step.TorchStep with dense "fsdp": FSDP2, the layout's
dispatcher, the one forward) in this process as a torch.distributed group of one (NCCL on the GPU,
gloo on the CPU, a TCPStore on 127.0.0.1 at a free port; torn down after the variant): one process
is a 1 x 1 (data x expert) mesh, so every expert sits on this device and the all-to-alls run over a
group of one. Against `torch` it prices what the layout's step costs before any second GPU.
`torch_layout` (and `torch_layout_cap`) is the same with the layout's dense parameters replicated
(torch_dense=replicate, the default on a GPU where they fit): the one-device step module TorchStep
on the rank of a 1 x 1 mesh, its gradient sums (engines/torch/parallel/replicate.py) a no-op there.
`torch_ep4_cap` is the one-device engine on the spec with model.ep_size 4 in capacity mode: the four
expert shards of a dp 1 x ep 4 layout emulated on one device. `olmo-core_v1_dropless` is OLMo-core's
first MoE in its dropless mode, through the grouped_gemm extension (built with nvcc on the GPU
machine: `pip install grouped_gemm`, or `python setup.py build_ext --inplace` from its sdist).

Results are appended to <out>/results.jsonl as each variant finishes (so a run cut short keeps what
it measured) and the tables are written to <out>/table.md after every variant. The column "vs
faster peer" is the row's tokens/s over the faster of OLMo-core and torchtitan at the same shape
in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch
# JAX's pool keeps what a variant freed and may not grow past this share of the card: at the
# default 0.75 the capacity variant, run after the dropless one, could not get its 41 GiB
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import numpy as np  # noqa: E402

from core.costs import flops_per_token  # noqa: E402
from core.rules import moe_model  # noqa: E402
from core.spec import Spec  # noqa: E402
from engines.data import TokenStream  # noqa: E402
from engines.lookahead import lookahead_steps  # noqa: E402
from engines.options import EngineOptions, JaxKernels  # noqa: E402

T_START = time.perf_counter()

BASE_MODEL = {
    "n_layers": 12, "d_model": 1024, "n_heads": 16, "n_kv_heads": 16, "head_dim": 64, "vocab_size": 50304,
    "n_routed_experts": 64, "top_k": 8, "n_shared_experts": 0, "expert_hidden": 512, "latent_dim": None,
    "dispatch": "dropless", "capacity_factor_send": 1.25, "capacity_factor_recv": 1.25, "n_waves": 1,
    "ep_size": 1, "attention_window": None,
}


TINY_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "vocab_size": 512,
              "n_routed_experts": 16, "top_k": 2, "expert_hidden": 32}
DEVICE = "cuda"
PEERS = ("olmo-core", "torchtitan")  # and olmo-core_v1, counted as OLMo-core


def d768_model(tiny: bool = False) -> dict:
    """Marin's d768 rung on one GPU (core.rules.moe_model(768, 8), one expert shard); --tiny: the
    same rules at d 64 (latent, 2 shared experts, 1 KV head, a window)."""
    if tiny:
        m = moe_model(64, 2, head_dim=16, vocab_size=512, n_routed_experts=16, top_k=2, window=64, ep_size=1,
                      dispatch="dropless")
    else:
        m = moe_model(768, 8, ep_size=1, dispatch="dropless")
    return m.model_dump()


def shape_of(name: str, tiny: bool) -> tuple[tuple, int, int, dict]:
    """(row key, sequence, batch, model overrides) of a bench shape: olmoe or d768."""
    if name == "olmoe":
        seq, batch = (128, 2) if tiny else (4096, 4)
        return (f"E{BASE_MODEL['n_routed_experts']}", seq), seq, batch, {}
    if name == "d768":
        seq, batch = (128, 2) if tiny else (4096, 8)
        return ("d768", seq), seq, batch, d768_model(tiny)
    raise ValueError(name)


def sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(*a):
    print(f"[{time.perf_counter() - T_START:6.1f}s]", *a, flush=True)


def make_spec(n_steps: int, seq: int = 4096, batch: int = 4, engine: str = "torch", optim: dict | None = None,
              **model):
    return Spec.model_validate({
        "name": "olmoe-like", "engine": engine, "seed": 0,
        "model": {**BASE_MODEL, **model},
        "data": {"sources": [{"name": "code", "builtin": "python_code", "weight": 0.7},
                             {"name": "docs", "builtin": "python_docs", "weight": 0.3}],
                 "seq_len": seq, "batch_size": batch, "total_tokens": seq * batch * (n_steps + 1)},
        "optim": {"peak_lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "grad_clip": 1.0,
                  **(optim or {})},
        "schedule": {"warmup_steps": 0, "decay": "constant"},
        "hardware": {"system": "h200", "n_gpus": 1, "peak_flops": 989e12, "hbm_gb": 141},
    })


def independent_flops_per_token(m: dict, seq: int) -> float:
    """6 x (attention + router + latent projections + top-k experts + shared experts + lm head)
    + 3 x causal (windowed) attention (QK^T and AV)."""
    d, L = m["d_model"], m["n_layers"]
    dl = m.get("latent_dim") or d
    attn = d * m["n_heads"] * m["head_dim"] * 2 + d * m["n_kv_heads"] * m["head_dim"] * 2
    latent = 2 * d * m["latent_dim"] if m.get("latent_dim") else 0
    shared = m.get("n_shared_experts", 0) * 3 * d * (m.get("shared_hidden") or 0)
    active = L * (attn + d * m["n_routed_experts"] + latent + m["top_k"] * 3 * dl * m["expert_hidden"] + shared)
    lm_head = d * m["vocab_size"]
    w = min(m.get("attention_window") or seq, seq)
    keys = sum(min(i + 1, w) for i in range(seq))
    return 6.0 * (active + lm_head) + 3.0 * (2 * 2 * L * (keys / seq) * m["n_heads"] * m["head_dim"])


# ---- the matmul ceiling ----------------------------------------------------------------------------


def matmul_ceiling(n: int = 8192, reps: int = 20) -> float:
    import torch

    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t)


# ---- variants ----------------------------------------------------------------------------------------


def timed_loop(launch, read, batches, warmup: int, sync, lookahead: bool = True):
    """(results, timed seconds, warm-up seconds) of warmup + timed steps, read(launch(batch)) for
    every batch through the engines' own loop (engines/lookahead.py: with lookahead, batch i + 1 is
    launched before step i is read; without, each step is read before the next is launched). The
    last warm-up step is read with nothing launched behind it, and the timed steps run between two
    device synchronisations."""
    t_w = time.perf_counter()
    t0 = t_w
    out = []
    for i, r in enumerate(lookahead_steps(0, len(batches), lambda i: launch(batches[i]), lambda i, h: read(h),
                                          lambda i: not lookahead or i == warmup - 1)):
        out.append(r)
        if i == warmup - 1:
            sync()
            t0 = time.perf_counter()
    sync()
    t1 = time.perf_counter()
    return out, t1 - t0, t0 - t_w


def read_at_once_tps(launch, read, batches, sync) -> float:
    """tokens/s of the same steps with each step read before the next is launched."""
    _, dt, _ = timed_loop(launch, read, batches, 0, sync, lookahead=False)
    return sum(b.shape[0] * (b.shape[1] - 1) for b in batches) / dt


def run_hf(spec, batches, warmup):
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    m = spec.model
    cfg = OlmoeConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.expert_hidden,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
        num_experts=m.n_routed_experts, num_experts_per_tok=m.top_k, max_position_embeddings=spec.data.seq_len,
        tie_word_embeddings=False, use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(spec.seed)  # its own initialisation, the same in every run
    with torch.device(DEVICE):
        model = OlmoeForCausalLM(cfg)
    model = model.to(torch.bfloat16).train()
    o = spec.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.peak_lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=DEVICE == "cuda")
    info = {"experts_implementation": str(getattr(cfg, "_experts_implementation", None)),
            "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
            "params": sum(p.numel() for p in model.parameters())}

    from engines.torch.step import HostCopy, to_device

    def launch(b):  # the engines' host handling (pinned upload, loss read after the next launch)
        x = to_device(b, torch.device(DEVICE))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        pending = HostCopy(loss.detach().float())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return pending

    losses, dt, t_warm = timed_loop(launch, lambda p: float(p.tolist()), batches, warmup, sync)
    return losses, dt, t_warm, info


def torch_options(options: dict | None = None, engine: dict | None = None) -> EngineOptions:
    """The EngineOptions of a torch variant, built here: the engine's defaults with the variant's
    engine fields on top (torch_master, ...), then its kernel choices (engines/options.TorchKernels
    fields)."""
    base = EngineOptions().replace(**(engine or {}))
    return base.replace(torch_kernels=dataclasses.replace(base.torch_kernels, **(options or {})))


def jax_options(kernels: dict | None = None, engine: dict | None = None) -> EngineOptions:
    """The EngineOptions of a JAX variant: the defaults with its engine fields (jax_mgpu, ...) and
    its choices (engines/options.JaxKernels fields)."""
    return EngineOptions().replace(**(engine or {}), jax_kernels=JaxKernels(**(kernels or {})))


def peak_lr_steps(step_module, spec):
    """(launch(batch) -> handle, read(handle) -> (loss, send drop share, receive drop share)) of
    an engine's own step module (engines/trainer.py's: TorchStep, JaxStep) on a fresh state, every
    step at the peak LR; a step that is not finite stops the variant."""
    step_module.init_fresh()
    lr = spec.optim.peak_lr

    def launch(b):
        return step_module.launch(0, b, lr)

    def read(handle):
        m, finite = step_module.read(handle)
        if not finite:
            raise FloatingPointError(f"loss {m['loss']}, grad norm {m['grad_norm']}")
        return m["loss"], m["drop_frac_send"], m["drop_frac_recv"]

    return launch, read


def torch_steps(spec, options: EngineOptions):
    """The torch engine's step module (engines/torch/step.TorchStep) on the bench's device."""
    import torch

    from engines.torch.step import TorchStep

    return peak_lr_steps(TorchStep(spec, torch.device(DEVICE), options), spec)


def jax_steps(spec, first_batch, options: EngineOptions, compiler_options: dict | None = None,
              keep_hlo: bool = False):
    """The JAX engine's step module (JaxEngine.step_module: its mesh, dtypes and kernels), its
    train step compiled once ahead of the loop (jit would compile again) with `compiler_options`:
    (launch, read, sync(), close(), info); info["hlo"] holds the compiled step's HLO text with
    keep_hlo."""
    import jax
    import jax.numpy as jnp

    from engines.jax.engine import JaxEngine, put_batch

    step = JaxEngine(options).step_module(spec)
    launch, read = peak_lr_steps(step, spec)
    info = {}
    hits = []  # the persistent compilation cache's hits while the step compiles (--jax-cache)

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(on_event)
    t_c = time.perf_counter()
    try:
        step.train_step = step.train_step.lower(step.state, put_batch(first_batch, step.mesh),
                                                jnp.float32(spec.optim.peak_lr)).compile(compiler_options)
    finally:
        jax.monitoring.unregister_event_listener(on_event)
    info["compile_s"] = time.perf_counter() - t_c
    info["step_from_cache"] = bool(hits)
    if keep_hlo:
        info["hlo"] = step.train_step.as_text()
    try:
        mem = step.train_step.memory_analysis()
        info["planned_bytes"] = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes
                                    + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    except Exception as err:  # memory_analysis is best effort across versions
        info["planned_bytes_error"] = repr(err)[:200]

    def sync():
        jax.block_until_ready(step.state)

    def close():
        step.state = None
        jax.clear_caches()

    return launch, read, sync, close, info


def run_torch(spec, batches, warmup, options: dict | None = None, engine: dict | None = None,
              adamw_block: int | None = None, profile_steps: int = 0):
    import torch

    from engines.torch.kernels import adamw_kernel

    saved_block = dict(adamw_kernel.BLOCK)
    if adamw_block:
        adamw_kernel.BLOCK.update({k: adamw_block for k in adamw_kernel.BLOCK})
    opts = torch_options(options, engine)
    try:
        torch._dynamo.reset()
        launch, read = torch_steps(spec, opts)
        out, dt, t_warm = timed_loop(launch, read, batches, warmup, sync)
        info = {"options": opts.to_dict(), "engine": dict(engine or {}),
                "drop_frac_recv": float(np.mean([o[2] for o in out[warmup:]])),
                "drop_frac_send": float(np.mean([o[1] for o in out[warmup:]])),
                "tokens_per_s_read_at_once": read_at_once_tps(launch, read, batches[warmup:], sync)}
        if profile_steps:  # after the timed steps, so the profiler costs them nothing
            info["breakdown"] = step_breakdown(launch, read, batches[warmup:], spec.model.model_dump(),
                                               profile_steps)
        del launch, read
        return [o[0] for o in out], dt, t_warm, info
    finally:
        adamw_kernel.BLOCK.update(saved_block)
        torch._dynamo.reset()  # compiled graphs can hold the model's tensors; JAX runs next
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


MESH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def mesh_of_one(spec):
    """The multi-process layout's own set-up (engines/torch/parallel/layout.setup_layout) as a
    process group of one: its rendezvous environment set here (127.0.0.1, a free port, world 1,
    rank 0; the store a TCPStore listening on 127.0.0.1), NCCL on the GPU, gloo on the CPU; a
    1 x 1 (data x expert) mesh. (layout, close()): close() destroys the group and puts the
    environment back, so a repeated variant meets on a fresh port."""
    import torch.distributed as dist

    from engines.torch.parallel.layout import free_port, setup_layout

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group exists already in this process")
    saved = {k: os.environ.get(k) for k in MESH_ENV}
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1",
                       "RANK": "0", "LOCAL_RANK": "0"})

    def close():
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    try:
        return setup_layout(spec.model, spec.data.batch_size, DEVICE), close
    except BaseException:
        close()
        raise


def run_torch_mesh(spec, batches, warmup, options: dict | None = None, engine: dict | None = None,
                   profile_steps: int = 0, dense: str = "fsdp"):
    """The torch row's model and batches trained through the multi-process layout's step module
    (engines/torch/step.TorchStep with dense "fsdp": FSDP2, the layout's dispatcher, the forward of
    engines/torch/parallel/model.py, torch's fused AdamW on the fp32 shards, gathered in bf16 on a GPU; the
    torch row's working copies, torch_master, do not exist there) under the engine's default
    kernel options, in this process as a group of one. One process is ep = 1 (layout.check_layout: the world is a
    multiple of ep; the one-device engine's emulated shards are its own dispatcher's, not the
    layout's), so the expert group is a group of one: every expert on this device, the dropless
    dispatch local (no exchange), FSDP2's collectives over the one rank. Its loop is the step module's own:
    each step read before the next is launched (its lookahead is off).
    dense "replicate": the layout's other dense sharding (engines/torch/parallel/replicate.py), the
    one-device step module (TorchStep) on this rank of the layout, with its lookahead."""
    import tempfile

    import torch

    from engines.torch.step import TorchStep

    opts = torch_options(options, engine)
    layout, close = mesh_of_one(spec)
    try:
        torch._dynamo.reset()
        with tempfile.TemporaryDirectory(prefix="torch_mesh_") as run_dir:
            step = TorchStep(spec, layout.device, opts, layout=layout, run_dir=Path(run_dir), dense=dense)
            launch, read = peak_lr_steps(step, spec)
            out, dt, t_warm = timed_loop(launch, read, batches, warmup, sync, lookahead=step.lookahead)
            info = {"options": opts.to_dict(), "engine": dict(engine or {}), "describe": step.describe(),
                    "mesh": [layout.dp, layout.ep], "backend": torch.distributed.get_backend(),
                    "lookahead": step.lookahead,
                    "drop_frac_recv": float(np.mean([o[2] for o in out[warmup:]])),
                    "drop_frac_send": float(np.mean([o[1] for o in out[warmup:]])),
                    "tokens_per_s_read_at_once": read_at_once_tps(launch, read, batches[warmup:], sync)}
            if profile_steps:  # after the timed steps, as run_torch's
                info["breakdown"] = step_breakdown(launch, read, batches[warmup:], spec.model.model_dump(),
                                                   profile_steps, lookahead=step.lookahead)
            del launch, read, step
        return [o[0] for o in out], dt, t_warm, info
    finally:
        torch._dynamo.reset()
        gc.collect()
        close()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def run_jax(spec, batches, warmup, engine: dict | None = None, compiler_options: dict | None = None,
            kernels: dict | None = None):
    import jax

    launch, read, jax_sync, close, info = jax_steps(spec, batches[0], jax_options(kernels, engine), compiler_options)
    info["kernels"] = dict(kernels or {})
    try:
        out, dt, t_warm = timed_loop(launch, read, batches, warmup, jax_sync)
        info["tokens_per_s_read_at_once"] = read_at_once_tps(launch, read, batches[warmup:], jax_sync)
        try:
            stats = jax.devices()[0].memory_stats() or {}
            info["process_peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))
        except Exception:
            pass
        info["drop_frac_recv"] = float(np.mean([o[2] for o in out[warmup:]]))
        info["drop_frac_send"] = float(np.mean([o[1] for o in out[warmup:]]))
        return [o[0] for o in out], dt, t_warm + info["compile_s"], info
    finally:
        close()


def run_peer(spec, batches, warmup, peer: str, **kw):
    """One peer (bench/peers.py) at its own settings: its trainer's step per batch."""
    import torch

    import peers

    trainer = {"olmo-core": peers.olmo_trainer, "olmo-core_v1": peers.olmo_v1_trainer,
               "torchtitan": peers.titan_trainer}[peer]
    # a peer may set compiler switches process-wide (torchtitan: capture_scalar_outputs); the
    # variants after it get the switches they would have had alone
    saved = (torch._dynamo.config.save_config(), torch._inductor.config.save_config())
    try:
        torch._dynamo.reset()
        launch, read, info = trainer(spec, DEVICE, **kw)
        out, dt, t_warm = timed_loop(launch, read, batches, warmup, sync)
        info["tokens_per_s_read_at_once"] = read_at_once_tps(launch, read, batches[warmup:], sync)
        del launch, read
        return out, dt, t_warm, info
    finally:
        try:
            from torchtitan.distributed.cudagraph import cudagraph_teardown

            cudagraph_teardown()
        except Exception:  # noqa: BLE001 - not imported, or nothing captured
            pass
        torch._dynamo.config.load_config(saved[0])
        torch._inductor.config.load_config(saved[1])
        torch._dynamo.reset()
        peers.close_process_group()  # the variants after it (the layouts) set up their own
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


# ---- where the torch step's time goes -----------------------------------------------------------------

BREAKDOWN = (  # first match wins, on lower-cased kernel names
    ("optimizer", r"adamw|fused_adam|multi_tensor|foreach|lpnorm|l2norm|_amp_"),
    ("attention", r"flash|fmha|cudnn|sdpa|attn|attention"),
    ("head and loss", r"xent|cross_entropy|log_softmax|nll_loss"),
    ("experts", r"grouped|groupproblem|_gmm|ragged|swiglu"),  # cutlass grouped GEMMs name GroupProblemShape
    ("router and dispatch", r"topk|sort|radix|scan|cumsum|histc|bincount|index|gather|scatter|cub::|softmax"),
    ("dense GEMM (attention projections, router logits, latent, shared experts)",
     r"gemm|nvjet|sm90|xmma|cutlass|cublas|matmul"),
    ("other elementwise (norms, RoPE, casts)", r"triton|elementwise|vectorized|reduce|copy|cast|fill|memset|memcpy"),
)


def kernel_category(name: str) -> str:
    import re

    low = name.lower()
    for cat, pat in BREAKDOWN:
        if re.search(pat, low):
            return cat
    return "other"


def gemm_owner(shapes, m: dict) -> str | None:
    """The output head, if a dense matmul's input shapes have a vocabulary-wide dimension; else
    None (the router's logits cannot be told apart this way: at d768 its [d, 384] matches the
    latent projection's)."""
    dims = {d for sh in shapes or [] for d in (sh or []) if isinstance(d, int)}
    return "head and loss" if m["vocab_size"] in dims else None


def step_breakdown(launch, read, batches, m: dict, steps: int, lookahead: bool = True) -> dict:
    """The GPU kernel time of `steps` more steps under torch.profiler, grouped by kernel name
    (BREAKDOWN); dense GEMMs launched by an aten op whose input shapes have the vocabulary are
    counted with the head (under CUDA graph replays the profiler sees no launching op, and they
    stay with the dense GEMMs; the breakdown then gives the head's share of their FLOPs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=acts, record_shapes=True) as prof:
        t0 = time.perf_counter()
        timed_loop(launch, read, batches[:steps], 0, sync, lookahead=lookahead)
        wall = time.perf_counter() - t0
    cats: dict[str, float] = {}
    kern: dict[str, float] = {}
    dev_type = torch.autograd.DeviceType.CUDA
    for ev in prof.events():
        if cuda and ev.device_type == dev_type and not getattr(ev, "is_user_annotation", False):
            t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            kern[ev.name] = kern.get(ev.name, 0.0) + t
            c = kernel_category(ev.name)
            cats[c] = cats.get(c, 0.0) + t
    moved: dict[str, float] = {}
    if cuda:  # dense GEMMs by their launching op's shapes
        for ev in prof.events():
            if ev.device_type == dev_type or not ev.name.startswith("aten::") or not ev.kernels:
                continue
            owner = gemm_owner(getattr(ev, "input_shapes", None), m)
            if owner is None:
                continue
            for k in ev.kernels:
                if kernel_category(k.name).startswith("dense GEMM"):
                    moved[owner] = moved.get(owner, 0.0) + k.duration
    dense_cat = next(c for c, _ in BREAKDOWN if c.startswith("dense GEMM"))
    for owner, t in moved.items():
        cats[dense_cat] = cats.get(dense_cat, 0.0) - t
        cats[owner] = cats.get(owner, 0.0) + t
    busy = sum(kern.values())
    # the host's side: CPU time by op (self time, so nested ops are not counted twice) and the calls
    # that wait for the GPU (a wait inside a step stops the host from launching ahead of it)
    averages = prof.key_averages()
    host = sorted(((a.key, a.self_cpu_time_total, a.count) for a in averages), key=lambda r: -r[1])[:25]
    waits = {a.key: a.count for a in averages
             if a.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                          "aten::_local_scalar_dense", "cudaMemcpy", "cudaMemcpyAsync")}
    d, L = m["d_model"], m["n_layers"]
    dense = L * (d * m["n_heads"] * m["head_dim"] * 2 + d * m["n_kv_heads"] * m["head_dim"] * 2
                 + d * m["n_routed_experts"] + (2 * d * m["latent_dim"] if m.get("latent_dim") else 0)
                 + m.get("n_shared_experts", 0) * 3 * d * (m.get("shared_hidden") or 0))
    head_share = d * m["vocab_size"] / (d * m["vocab_size"] + dense)
    return {"steps": steps, "head_share_of_dense_gemm_flops": head_share, "wall_ms_per_step": 1e3 * wall / steps, "kernel_ms_per_step": busy / 1e3 / steps,
            "categories_ms_per_step": {c: v / 1e3 / steps for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "moved_by_shape_ms_per_step": {c: v / 1e3 / steps for c, v in moved.items()},
            "top_kernels_ms_per_step": [(k[:150], kernel_category(k), v / 1e3 / steps)
                                        for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[:25]],
            "top_host_ops_ms_per_step": [(k[:150], v / 1e3 / steps, n / steps) for k, v, n in host],
            "host_waits_per_step": {k: n / steps for k, n in waits.items()}}


def breakdown_md(variant: str, key, b: dict) -> str:
    lines = [f"### {variant} at {key[0]} seq {key[1]}: {b['wall_ms_per_step']:.1f} ms/step wall, "
             f"{b['kernel_ms_per_step']:.1f} ms/step of GPU kernels ({b['steps']} profiled steps)", "",
             "| part of the step | ms/step | share of kernel time |", "|---|---:|---:|"]
    busy = max(b["kernel_ms_per_step"], 1e-9)
    for c, v in b["categories_ms_per_step"].items():
        lines.append(f"| {c} | {v:.2f} | {v / busy:.1%} |")
    if b["moved_by_shape_ms_per_step"]:
        lines += ["", "Dense GEMMs counted by their op's shapes: " + ", ".join(
            f"{c} {v:.2f} ms" for c, v in b["moved_by_shape_ms_per_step"].items())]
    else:
        lines += ["", "No dense GEMM was attributed by shape (CUDA graph replays have no launching op): the "
                  f"output head is {b['head_share_of_dense_gemm_flops']:.0%} of the dense GEMMs' FLOPs."]
    lines += ["", "| kernel | part | ms/step |", "|---|---|---:|"]
    lines += [f"| `{k}` | {c} | {v:.2f} |" for k, c, v in b["top_kernels_ms_per_step"]]
    if b.get("top_host_ops_ms_per_step"):
        lines += ["", "| host op (self CPU time) | ms/step | calls/step |", "|---|---:|---:|"]
        lines += [f"| `{k}` | {v:.2f} | {n:.0f} |" for k, v, n in b["top_host_ops_ms_per_step"]]
        lines += ["", "Host calls that wait for the device, per step: " + (", ".join(
            f"{k} {n:.0f}" for k, n in b["host_waits_per_step"].items()) or "none")]
    return "\n".join(lines) + "\n"


# ---- driver ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    ap.add_argument("--only", default="ref,torch,torch_cap,jax,jax_cap",
                    help="comma list of: ref, olmo-core, olmo-core_v1, olmo-core_v1_dropless, torchtitan, torch, torch_cap, torch_mesh, torch_mesh_cap, torch_layout, torch_layout_cap, torch_ep4_cap, jax, jax_cap, torch_eager, torch_dense, "
                         "torch_cudnn, torch_castmasters, torch_inductorgather, torch_cudagraphs, torch_compileadam, torch_torchdw, torch_fusedswiglu, torch_fusedgather, torch_fp32router, torch_inductorswiglu, torch_bf16moments, torch_ropebhsq, torch_inductorxent, torch_combinekernel, torch_combinebf16, torch_combinegraphs, torch_nographs, torch_block1024, torch_bf16graphs, torch_maskattn, torch_maskattn_cap, torch_torchtopk, torch_flexcausal, jax_bf16moments, jax_defaulttiles, jax_cublas, jax_xlaloss, jax_castweights, jax_before, jax_autodiffexperts, jax_allbefore, jax_gathergates")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the --only list this many times over, interleaved (run-to-run spread)")
    ap.add_argument("--scaling", action="store_true", help="also 8 and 128 experts, and sequence 8192")
    ap.add_argument("--scaling-engines", default="torch,jax,ref", help="in this order")
    ap.add_argument("--scaling-shapes", default="E/8,2E,2S", help="of E/8 (experts / 8), 2E, 2S (sequence x 2)")
    ap.add_argument("--budget-s", type=float, default=560.0, help="skip what would start after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a smoke run; the CPU if no GPU)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="--tiny on the CPU even where there is a GPU (JAX on its CPU backend too): the command "
                         "line, every variant's step and the rows it writes, at no device time")
    ap.add_argument("--shape", default="olmoe", choices=("olmoe", "d768"), help="the shape of the --only list")
    ap.add_argument("--d768", default="", help="variants to run at the d768 shape after the --only list")
    ap.add_argument("--then", default="", help="variants at the --shape shape run last, after the --d768 list")
    ap.add_argument("--profile", default="", help="torch variants whose step is profiled after timing")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--jax-cache", default="",
                    help="JAX's persistent compilation cache in this folder: a JAX variant compiled once (in "
                         "this process, or an earlier one on the same machine) loads instead of compiling again, "
                         "so --repeat costs one compile a variant; the row's info.step_from_cache says which it was")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.tiny = True
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX is first imported, below

    import torch

    global DEVICE, BASE_MODEL
    if args.cpu_smoke or not torch.cuda.is_available():
        if not args.tiny:
            print("bench/engines_h200.py needs a CUDA GPU (or --tiny for a smoke run)", file=sys.stderr)
            return 2
        DEVICE = "cpu"
    if args.tiny:
        BASE_MODEL = {**BASE_MODEL, **TINY_MODEL}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError as err:
        hf_version = f"unavailable: {err}"
    env = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": hf_version, "grouped_mm": hasattr(torch, "_grouped_mm")}
    try:
        import jax

        env["jax"] = jax.__version__
        if args.jax_cache:
            env["jax_cache"] = str(Path(args.jax_cache).resolve())
            jax.config.update("jax_compilation_cache_dir", env["jax_cache"])
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    except Exception as err:
        env["jax"] = f"unavailable: {err}"
    log("env", env)
    ceiling = matmul_ceiling() if DEVICE == "cuda" else matmul_ceiling(512, 3)
    log(f"bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s")

    rows: list[dict] = []
    ref_tps: dict[tuple, float] = {}

    def record(row):
        rows.append(row)
        with open(results_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        (out / "table.md").write_text(format_tables(rows, ceiling, env, args))  # kept if cut short
        if "breakdown" in row.get("info", {}):
            with open(out / "breakdown.md", "a") as f:
                f.write(breakdown_md(row["variant"], row["key"], row["info"]["breakdown"]) + "\n")

    def run_variant(name, runner, spec, batches, key, **kw):
        if time.perf_counter() - T_START > args.budget_s:
            log(f"skip {name} {key}: past the time budget")
            return
        import torch

        gc.collect()
        # what is alive between variants (modules, the batches, the rows) stays alive: frozen, the
        # collections inside a variant and after it scan only what the variant made (each full
        # collection over torch's and JAX's objects took about 0.2 s)
        gc.freeze()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if DEVICE == "cuda":
            log(f"run {name} {key} (torch holds {torch.cuda.memory_reserved() / 2**30:.1f} GiB)")
        else:
            log(f"run {name} {key}")
        try:
            losses, dt, t_warm, info = runner(spec, batches, args.warmup, **kw)
        except Exception as err:
            log(f"FAILED {name} {key}: {type(err).__name__}: {err}")
            traceback.print_exc()
            record({"variant": name, "key": list(key), "error": f"{type(err).__name__}: {err}"[:2000]})
            if name in ("torch", "torch_cap") and runner is run_torch and "options" not in kw:
                # the engine's defaults failed: measure the options an earlier H200 run passed with
                run_variant(name + "_fallback", runner, spec, batches, key,
                            options={"attn_backend": None, "grouped_mm_weights": "kmajor"},
                            engine={"torch_master": False})
            if name == "torchtitan" and DEVICE == "cuda":  # its CUDA graph capture failed? run without
                run_variant("torchtitan_nographs", runner, spec, batches, key, peer="torchtitan", cuda_graphs=False)
            if name == "olmo-core_v1" and DEVICE == "cuda":  # its compile failed? run eager
                run_variant("olmo-core_v1_eager", runner, spec, batches, key, peer="olmo-core_v1", compile_=False)
            return
        S = spec.data.seq_len
        n_tok = args.steps * spec.data.batch_size * S
        tps = n_tok / dt
        fpt = flops_per_token(spec, S)
        if name.startswith("jax"):
            peak = info.get("planned_bytes", 0)
        else:
            peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
        row = {"variant": name, "key": list(key), "tokens_per_s": tps, "tflops": tps * fpt / 1e12,
               "mfu": tps * fpt / ceiling, "peak_gib": peak / 2**30, "warmup_s": t_warm, "timed_s": dt,
               "flops_per_token": fpt, "losses": losses, "timed_losses": losses[args.warmup:], "info": info}
        if name == "ref":
            ref_tps[key] = tps
            for r in rows:  # variants of this shape timed before the reference
                if tuple(r["key"]) == key and "tokens_per_s" in r:
                    r["vs_ref"] = r["tokens_per_s"] / tps
        row["vs_ref"] = tps / ref_tps[key] if key in ref_tps else None
        log(f"{name} {key}: {tps:,.0f} tok/s, {row['tflops']:.0f} TFLOP/s, MFU {row['mfu']:.1%}, "
            f"peak {row['peak_gib']:.1f} GiB, warm-up {t_warm:.0f}s"
            f"{' (step from the compilation cache)' if info.get('step_from_cache') else ''}, "
            f"losses {losses[0]:.3f} -> {losses[-1]:.3f}")
        record(row)
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    n_total = args.warmup + args.steps
    runners = {
        # the engine's fast path with the working copies it keeps for runs of 40 minutes or
        # more (a bench run is far shorter, so they are asked for)
        "ref": (run_hf, {}), "torch": (run_torch, {"engine": {"torch_master": True}}),
        "torch_cap": (run_torch, {"engine": {"torch_master": True}}),
        # the same model through the multi-process layout's step module as a process group of one
        # (run_torch_mesh: FSDP2 over one rank, the layout's dispatcher, the fast forward)
        "torch_mesh": (run_torch_mesh, {}), "torch_mesh_cap": (run_torch_mesh, {}),
        # the layout with its dense parameters replicated (the default where they fit a GPU): the
        # one-device step module on a rank of a 1 x 1 mesh, the working copies as the torch row's
        "torch_layout": (run_torch_mesh, {"dense": "replicate", "engine": {"torch_master": True}}),
        "torch_layout_cap": (run_torch_mesh, {"dense": "replicate", "engine": {"torch_master": True}}),
        # the one-device engine emulating 4 expert shards (capacity dispatch by the pooled-wave
        # rules per shard pair: what a dp 1 x ep 4 layout computes, on one device)
        "torch_ep4_cap": (run_torch, {"engine": {"torch_master": True}, "model": {"ep_size": 4}}),
        "torch_eager": (run_torch, {"options": {"compile": "none"}}),
        "torch_dense": (run_torch, {"options": {"compile": "dense"}}),
        "torch_cudnn": (run_torch, {"options": {"attn_backend": "cudnn"}}),
        "torch_nmajor": (run_torch, {"options": {"grouped_mm_weights": "nmajor"}}),
        # the compiled blocks and head replayed as CUDA graphs (no kernel-to-kernel launch gaps),
        # with Inductor's combine gradient
        "torch_cudagraphs": (run_torch, {"engine": {"torch_master": True},
                                         "options": {"compile": "block-cudagraphs", "combine_grad": "inductor"}}),
        # the combine's and dispatch backward's gather-and-sum fused by Inductor instead of by
        # engines/torch/kernels/gather.py's Triton kernels (the default where Triton is installed)
        "torch_inductorgather": (run_torch, {"engine": {"torch_master": True},
                                             "options": {"gather": "inductor"}}),
        # the expert matmuls' weight gradients by _grouped_mm's backward instead of
        # engines/torch/kernels/grouped_dw.py's kernel
        "torch_torchdw": (run_torch, {"engine": {"torch_master": True},
                                      "options": {"grouped_dw": "torch"}}),
        # the experts' SwiGLU inside the grouped matmuls' epilogues (engines/torch/kernels/swiglu_gemm.py)
        "torch_fusedswiglu": (run_torch, {"engine": {"torch_master": True},
                                          "options": {"experts": "fused"}}),
        # the same, and the dispatch's row gather inside the up matmul and its weight gradient
        "torch_fusedgather": (run_torch, {"engine": {"torch_master": True},
                                          "options": {"experts": "fused-gather"}}),
        # MasterAdamW's update as Inductor's graphs per parameter group instead of its default,
        # one Triton kernel per tensor (engines/torch/kernels/adamw_kernel.py)
        "torch_compileadam": (run_torch, {"engine": {"torch_master": True}, "options": {"adamw": "compile"}}),
        # the router's logits matmul on fp32 SIMT cores instead of TF32 tensor cores (tf32.py's op)
        "torch_fp32router": (run_torch, {"engine": {"torch_master": True}, "options": {"router": "fp32"}}),
        # the experts' SwiGLU backward by Inductor instead of engines/torch/kernels/swiglu.py's kernel
        "torch_inductorswiglu": (run_torch, {"engine": {"torch_master": True},
                                             "options": {"swiglu": "inductor"}}),
        # Adam's moments stored in bf16 (the spec's optim.moments; 20 bytes a parameter instead of 28)
        "torch_bf16moments": (run_torch, {"engine": {"torch_master": True}, "optim": {"moments": "bf16"}}),
        # RoPE on q and k transposed to [B, H, S, Q] (the default before bshq)
        "torch_ropebhsq": (run_torch, {"engine": {"torch_master": True}, "options": {"rope_layout": "bhsq"}}),
        # the output head's losses fused by Inductor instead of engines/torch/kernels/xent.py's kernels
        "torch_inductorxent": (run_torch, {"engine": {"torch_master": True}, "options": {"xent": "inductor"}}),
        # the combine's backward for the sorted rows by gather.py's gather-scale kernel instead of
        # Inductor's fusion, without CUDA graphs; and the same with bf16 moments
        "torch_combinekernel": (run_torch, {"engine": {"torch_master": True},
                                            "options": {"combine_grad": "triton", "compile": "block"}}),
        "torch_combinebf16": (run_torch, {"engine": {"torch_master": True}, "optim": {"moments": "bf16"},
                                          "options": {"combine_grad": "triton", "compile": "block"}}),
        # the combine kernel with the blocks and head replayed as CUDA graphs (the defaults since
        # run T in docs/results/engines-h200.md, where Triton is installed)
        "torch_combinegraphs": (run_torch, {"engine": {"torch_master": True},
                                            "options": {"combine_grad": "triton", "compile": "block-cudagraphs"}}),
        # the defaults before CUDA graphs and the combine kernel were (blocks compiled, Inductor's
        # combine gradient)
        "torch_nographs": (run_torch, {"engine": {"torch_master": True},
                                       "options": {"compile": "block", "combine_grad": "inductor"}}),
        # MasterAdamW's kernel at 1,024 elements a program for fp32 moments too (the block before)
        "torch_block1024": (run_torch, {"engine": {"torch_master": True}, "adamw_block": 1024}),
        # bf16 moments with the default graphs and combine kernel
        "torch_bf16graphs": (run_torch, {"engine": {"torch_master": True}, "optim": {"moments": "bf16"},
                                         "options": {"combine_grad": "triton", "compile": "block-cudagraphs"}}),
        # the matmuls cast the fp32 masters every step, torch's fused AdamW (no working copies)
        "torch_castmasters": (run_torch, {"engine": {"torch_master": False}}),
        # a sliding window (the d768 shape) through SDPA with a dense [S, S] mask instead of
        # FlexAttention's block mask (the default on a GPU before)
        "torch_maskattn": (run_torch, {"engine": {"torch_master": True},
                                       "options": {"window_attention": "mask"}}),
        "torch_maskattn_cap": (run_torch, {"engine": {"torch_master": True},
                                           "options": {"window_attention": "mask"}}),
        # plain causal attention (the OLMoE shape) through FlexAttention instead of SDPA's cuDNN kernel
        "torch_flexcausal": (run_torch, {"engine": {"torch_master": True},
                                         "options": {"causal_attention": "flex"}}),
        # the router's top-k by torch.topk instead of engines/torch/kernels/topk.py's kernel
        "torch_torchtopk": (run_torch, {"engine": {"torch_master": True}, "options": {"topk": "torch"}}),
        "jax": (run_jax, {}), "jax_cap": (run_jax, {}),
        # the peers at their own recommended settings (bench/peers.py)
        "olmo-core": (run_peer, {"peer": "olmo-core"}), "torchtitan": (run_peer, {"peer": "torchtitan"}),
        # OLMo-core's first MoE (capacity experts by torch.bmm), where its current one cannot run
        "olmo-core_v1": (run_peer, {"peer": "olmo-core_v1"}),
        # its dropless MoE (MoEType.dropless: the grouped_gemm extension, built on the GPU machine)
        "olmo-core_v1_dropless": (run_peer, {"peer": "olmo-core_v1", "dropless": True}),
        # the same without torch.compile (where Inductor fails on its attention at d768)
        "olmo-core_v1_dropless_eager": (run_peer, {"peer": "olmo-core_v1", "dropless": True, "compile_": False}),
        "jax_bf16moments": (run_jax, {"optim": {"moments": "bf16"}}),
        # the expert matmuls with one Mosaic-GPU tile configuration (fast.MGPU) instead of the
        # per-matmul ones tuned by bench/tune_mgpu.py
        "jax_defaulttiles": (run_jax, {"engine": {"jax_mgpu": "default"}}),
        # XLA's own GEMM choice without its Triton GEMM fusions (cuBLAS for every matmul)
        "jax_cublas": (run_jax, {"compiler_options": {"xla_gpu_enable_triton_gemm": False}}),
        # the head's losses by autodiff over fp32 logits instead of engines/jax/loss.py's custom VJP
        "jax_xlaloss": (run_jax, {"kernels": {"loss": "xla"}}),
        # every matmul casting its fp32 master instead of reading the working copies
        "jax_castweights": (run_jax, {"kernels": {"weights": "cast"}}),
        # the dropless experts' SwiGLU and combine by autodiff instead of engines/jax/fast.py's VJPs
        "jax_autodiffexperts": (run_jax, {"kernels": {"experts": "autodiff"}}),
        # the router's gates by take_along_axis (a scatter-add gradient) instead of moe.pick
        "jax_gathergates": (run_jax, {"kernels": {"gates": "gather"}}),
        # the fused losses and working copies both off (the experts' VJPs kept)
        "jax_before": (run_jax, {"kernels": {"loss": "xla", "weights": "cast"}}),
        # all three off: the JAX step as it was before them
        "jax_allbefore": (run_jax, {"kernels": {"loss": "xla", "weights": "cast", "experts": "autodiff"}}),
    }

    profiled = {n for n in args.profile.split(",") if n}

    def sweep(names, key, seq=4096, batch=4, **model):
        spec0 = make_spec(n_total, seq=seq, batch=batch, **model)
        if DEVICE == "cpu" and any(n.split("_")[0] in PEERS for n in names):  # the peers' shapes, no GPU
            record_meta(spec0, key)
        stream = TokenStream.from_spec(spec0)
        batches = [stream.batch(i) for i in range(n_total)]
        f_ind = independent_flops_per_token(spec0.model.model_dump(), seq)
        log(f"{key}: flops/token core.costs {flops_per_token(spec0, seq):.4e}, independent {f_ind:.4e}")
        for name in names:
            runner, kw = runners[name]
            kw = dict(kw)
            cap = name.endswith("_cap")
            spec = make_spec(n_total, seq=seq, batch=batch, engine="jax" if name.startswith("jax") else "torch",
                             optim=kw.pop("optim", None),
                             **{**model, **kw.pop("model", {}), "dispatch": "capacity" if cap else "dropless"})
            if DEVICE == "cpu" and name.split("_")[0] in PEERS:  # CUDA only (bench/peers.py): meta rows above
                continue
            if name in profiled and runner in (run_torch, run_torch_mesh):
                kw["profile_steps"] = args.profile_steps
            run_variant(name, runner, spec, batches, key, **kw)

    def record_meta(spec0, key):
        import peers

        try:
            got = peers.meta_shapes(spec0)
        except ImportError as err:
            got = {"error": f"peers not importable: {err}"}
        for peer in ("olmo-core", "olmo-core_v1", "torchtitan"):
            p = got.get(peer, {"error": got.get("error")})
            row = {"variant": f"{peer}_meta", "key": list(key), "meta": p, "ours_params": got.get("ours_params")}
            if "error" in p:
                row["error"] = p["error"]
            log(f"{peer} on the meta device at {key}: {p}")
            record(row)

    main_names = [n for n in args.only.split(",") if n]
    unknown = set(main_names) - set(runners)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; known: {sorted(runners)}", file=sys.stderr)
        return 2
    d768_names = [n for n in args.d768.split(",") if n]
    then_names = [n for n in args.then.split(",") if n]
    unknown = set(d768_names + then_names) - set(runners)
    if unknown:
        print(f"unknown variants {sorted(unknown)}; known: {sorted(runners)}", file=sys.stderr)
        return 2
    if "olmo-core_v1" in d768_names and "olmo-core_v1" not in main_names and DEVICE == "cuda":
        log("note: olmo-core_v1 at d768 failed as the process's first OLMo-core build (an Inductor stride "
            "assertion in SDPA's flash backward, then out of memory eagerly; docs/results/peers_h200/call6_*, call7_*) "
            "and ran after an olmo-core_v1 row at the OLMoE shape: add olmo-core_v1 to --only")
    key, s_main, b_main, m_main = shape_of(args.shape, args.tiny)
    sweep(main_names * max(args.repeat, 1), key, seq=s_main, batch=b_main, **m_main)
    if d768_names:
        key, s2, b2, m2 = shape_of("d768", args.tiny)
        sweep(d768_names, key, seq=s2, batch=b2, **m2)
    if then_names:
        key, s_main, b_main, m_main = shape_of(args.shape, args.tiny)
        sweep(then_names, key, seq=s_main, batch=b_main, **m_main)
    seq, batch = (128, 2) if args.tiny else (4096, 4)
    E = BASE_MODEL["n_routed_experts"]
    if args.scaling:  # engine by engine, so a cut-off run has whole scaling rows of the first ones
        for name in [n for n in args.scaling_engines.split(",") if n]:
            shapes = {"E/8": ((f"E{E // 8}", seq), seq, batch, {"n_routed_experts": E // 8}),
                      "2E": ((f"E{2 * E}", seq), seq, batch, {"n_routed_experts": 2 * E}),
                      "2S": ((f"E{E}", 2 * seq), 2 * seq, batch // 2, {})}
            for shape in args.scaling_shapes.split(","):
                key, s2, b2, model = shapes[shape]
                sweep([name], key, seq=s2, batch=b2, **model)

    table = format_tables(rows, ceiling, env, args)
    (out / "table.md").write_text(table)
    print(table)
    return 0


def shape_order(k) -> tuple:
    name = k[0]
    return (k[1], 1 if name.startswith("d") else 0, int(name[1:]) if name[1:].isdigit() else 0, name)


def faster_peer(rows, key) -> tuple[str, float] | None:
    """The peer (OLMo-core or torchtitan, any of its rows) with the most tokens/s at this key."""
    best = None
    for r in rows:
        base = r["variant"].split("_")[0]
        if base in PEERS and tuple(r["key"]) == tuple(key) and "tokens_per_s" in r:
            if best is None or r["tokens_per_s"] > best[1]:
                best = (r["variant"], r["tokens_per_s"])
    return best


def format_tables(rows, ceiling, env, args) -> str:
    lines = [f"GPU {env['gpu']}; torch {env['torch']}, transformers {env['transformers']}, jax {env.get('jax')}; "
             f"bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s; {args.warmup} warm-up + {args.steps} timed steps.", ""]
    lines.append("| shape | variant | tokens/s | model TFLOP/s | MFU | peak GiB | vs reference | vs faster peer | "
                 "warm-up s | loss first -> last timed | tokens/s, each step read at once |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        shape = f"{r['key'][0]} seq {r['key'][1]}"
        if "meta" in r and "error" not in r:
            p = r["meta"]
            lines.append(f"| {shape} | {r['variant']} | meta device: {p.get('params', 0):,} parameters "
                         f"(the bench's {r.get('ours_params') or 0:,}) | | | | | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {shape} | {r['variant']} | failed: {r['error'][:120]} | | | | | | | | |")
            continue
        vs = f"{r['vs_ref']:.2f}x" if r.get("vs_ref") else "-"
        peer = faster_peer(rows, r["key"])
        vp = f"{r['tokens_per_s'] / peer[1]:.2f}x" if peer else "-"
        tl = r["timed_losses"]
        once = r["info"].get("tokens_per_s_read_at_once")
        at_once = f"{once:,.0f}" if once else "-"
        lines.append(f"| {shape} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {r['mfu']:.1%} | "
                     f"{r['peak_gib']:.1f} | {vs} | {vp} | {r['warmup_s']:.0f} | {tl[0]:.3f} -> {tl[-1]:.3f} | "
                     f"{at_once} |")
    ok = [r for r in rows if "tokens_per_s" in r]
    keys = sorted({tuple(r["key"]) for r in ok}, key=shape_order)
    peer_keys = [k for k in keys if faster_peer(rows, k)]
    if peer_keys:
        lines += ["", "Faster peer per shape: " + "; ".join(
            f"{k[0]} seq {k[1]}: {faster_peer(rows, k)[0]} {faster_peer(rows, k)[1]:,.0f} tokens/s" for k in peer_keys)]
    if len(keys) > 1 and any(k[0].startswith("E") for k in keys) and len({k for k in keys if k[0].startswith("E")}) > 1:
        ekeys = [k for k in keys if k[0].startswith("E")]
        variants = list(dict.fromkeys(r["variant"] for r in ok))
        tps = {(r["variant"], tuple(r["key"])): r["tokens_per_s"] for r in ok}
        lines += ["", "Scaling (tokens/s; in brackets the change against the first shape of the row):", "",
                  "| variant | " + " | ".join(f"{k[0]} seq {k[1]}" for k in ekeys) + " |",
                  "|---|" + "---:|" * len(ekeys)]
        for v in variants:
            base = next((tps[(v, k)] for k in ekeys if (v, k) in tps), None)
            if base is None:
                continue
            cells = [f"{tps[(v, k)]:,.0f} ({tps[(v, k)] / base - 1:+.1%})" if (v, k) in tps else "-" for k in ekeys]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Losses, every step (warm-up steps first):")
    for r in rows:
        if "losses" in r:
            lines.append(f"- {r['key'][0]} seq {r['key'][1]} {r['variant']}: "
                         + " ".join(f"{v:.3f}" for v in r["losses"]))
    configs = [r for r in rows if r.get("info", {}).get("config")]
    if configs:
        lines += ["", "Peer configurations (as run):"]
        seen = set()
        for r in configs:
            c = json.dumps(r["info"]["config"], sort_keys=True)
            if (r["variant"], c) not in seen:
                seen.add((r["variant"], c))
                lines.append(f"- {r['key'][0]} {r['variant']}: `{c}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
