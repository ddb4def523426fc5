"""The torch engine's peers on one GPU: OLMo-core 3's MoE transformer and torchtitan's Qwen3 MoE,
each built and stepped the way its own trainer does it, at its own recommended settings, on the
bench's shape and the bench's batches.

- OLMo-core (`ai2-olmo-core` 3.0.0): `OLMoDDPModel` (`TransformerType.moe_fused_v2`, the MoE
  stack of its tech-report recipes: dropless routed experts through `torch._grouped_mm`, a
  softmax top-k router with a load-balancing loss), trained by its `OLMoDDPTrainModule`
  (`compile_model=True`, DDP over one rank with fp32 gradient accumulation) and its
  `OLMoDDPOptimizer` (fp32 masters, fused AdamW with skip-step spike detection, its update path
  compiled). One step is what its `Trainer` runs: `train_batch`, `optim_step`, `zero_grads`.
- torchtitan (0.3.0, or 0.2.x where torch is older than 0.3.0 needs; the installed version picks
  the builder): `Qwen3Model` with MoE layers (its MoE family that matches this shape: GQA with
  QK-norm, softmax top-k router, `GroupedExperts` through `torch._grouped_mm`). 0.3.0: parallelised
  by `parallelize_qwen3` (FSDP2 over one rank: bf16 parameters, fp32 reduction; per-block
  `torch.compile`), AdamW from `default_adamw` (torch's AdamW on fp32 parameters), its chunked
  cross-entropy (compiled), FlexAttention (its default attention backend) and its forward-backward
  captured as a CUDA graph (its Trainer's default). 0.2.x: its Trainer's one-GPU path (no FSDP:
  fp32 parameters under bf16 autocast; per-block `torch.compile`), fused AdamW from
  `build_optimizers`, its cross-entropy (compiled) and SDPA (Qwen3's default there). One step is
  its `Trainer.train_step`: zero grads, the forward-backward, `clip_grad_norm_`, the optimizer step.

Both need torch.distributed: a one-rank process group on 127.0.0.1 is started once per process.
Neither trains without CUDA: OLMo-core's optimizer takes only `torch.cuda` tensors (it tells
fp32 from bf16 parameters by `param.type()` names such as "torch.cuda.BFloat16Tensor"), and
torchtitan builds its device mesh on "cuda" whenever it finds no other accelerator. Without a GPU
the bench builds both on the meta device instead (`meta_shapes`). Neither package is imported
until a peer is asked for, so the bench runs without them.

`*_settings()` return each peer's exact configuration as a dict (written into the bench's
results and into docs/results/engines-h200.md), and `meta_shapes()` builds both on the meta device and
counts their parameters and FLOPs against the bench's own count, which needs no GPU.
"""

from __future__ import annotations

import math
import os
import socket
import time
from typing import Any

import torch

from engines.torch.step import to_device
from core.costs import param_counts

PEERS = ("olmo-core", "torchtitan")

# OLMo-core's recipe (src/scripts/train/tech_report/moe_8l_ddp_*.py in allenai/OLMo-core): the
# values each peer is run with, besides the shape. The learning rate and betas are the bench's.
OLMO_ROUTER = {"gating_function": "softmax", "lb_loss_weight": 0.01, "z_loss_weight": 1e-4,
               "lb_loss_granularity": "local_batch", "normalize_expert_weights": 1.0,
               "restore_weight_scale": True}
OLMO_TRAIN = {"compile_model": True, "optim_compile": True, "optim_dtype": "float32",
              "dp": "ddp, reduce_grads_in_fp32, accumulate_grads_in_fp32", "z_loss_multiplier": 1e-4,
              "max_grad_norm": 1.0, "sigma_factor": 12, "embeddings_weight_decay": 0.0,
              "block": "moe_fused_v2 (OLMoDDPTransformerBlock), post-norm with QK-norm",
              "attention_backend": "torch (SDPA)"}
# Why not flash_4 / flash_2, the recipe's backends: they need flash-attn-4 (with the CUTLASS DSL)
# or flash-attn, neither on the GPU image; nvidia-cutlass-dsl-libs-base 4.5.3 alone is a 74.5 MB
# wheel, more than the 64 MiB that travels with a call, and flash-attn is built from source.
# SDPA runs PyTorch's own flash-attention kernels.
TITAN_TRAIN = {"compile": "enable=True, components=[model, loss] (per-block torch.compile)",
               "attention_backend": "flex (FlexAttention, compiled with max_autotune)",
               "cuda_graphs": "forward-backward captured (training.disable_cuda_graphs=False)",
               "fsdp": "fully_shard over one rank, param bf16, reduce fp32",
               "optimizer": "default_adamw: AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)",
               "loss": "ChunkedLossWrapper(CrossEntropyLoss), 8 chunks", "max_norm": 1.0,
               "moe": "make_moe_config: TokenChoiceTopKRouter(softmax, route_norm), GroupedExperts, "
                      "LocalTokenDispatcher (no EP), load-balancing bias hook"}

_PG: dict[str, Any] = {}


def ensure_process_group(device: str) -> None:
    """One rank of torch.distributed on 127.0.0.1 (both peers' trainers refuse to run without it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0) if device == "cuda" else None)
    _PG["backend"] = dist.get_backend()


def close_process_group() -> None:
    """Destroy the group ensure_process_group made, where it made one."""
    import torch.distributed as dist

    if _PG and dist.is_initialized():
        dist.destroy_process_group()
    _PG.clear()


# ---- OLMo-core ------------------------------------------------------------------------------------


def olmo_settings(m, seq: int) -> dict:
    """OLMo-core's configuration at the bench's model shape m (a core.spec.ModelSpec)."""
    out = {"package": "ai2-olmo-core 3.0.0", "model": "OLMoDDPModelConfig(name=moe_fused_v2)",
           "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
           "head_dim": m.head_dim, "vocab_size": m.vocab_size, "num_experts": m.n_routed_experts,
           "top_k": m.top_k, "expert_hidden": m.expert_hidden, "latent_dim": m.latent_dim,
           "shared_experts": (f"one always-on SwiGLU of width {m.n_shared_experts} x {m.shared_hidden} "
                              f"(= {m.n_shared_experts} summed)" if m.n_shared_experts else 0),
           "sliding_window": m.attention_window, "seq": seq,
           "ep": "none (one GPU: no expert parallelism, combined_forward_no_ep)",
           "dispatch": "dropless" if m.dispatch == "dropless" else
           "dropless (its no-EP path has no capacity mode; capacity applies to its EP paths)",
           "router": OLMO_ROUTER, **OLMO_TRAIN}
    return out


def olmo_model_config(m, seq: int):
    from olmo_core.config import DType
    from olmo_core.nn.attention import AttentionConfig, AttentionType, SlidingWindowAttentionConfig
    from olmo_core.nn.attention.backend import AttentionBackendName
    from olmo_core.nn.ddp.block import OLMoDDPTransformerBlockConfig
    from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
    from olmo_core.nn.lm_head import LMHeadConfig
    from olmo_core.nn.moe import MoELoadBalancingLossGranularity, MoERouterGatingFunction
    from olmo_core.nn.moe.moe import LatentMoEConfig
    from olmo_core.nn.moe.v2.routed_experts import RoutedExpertsConfig
    from olmo_core.nn.moe.v2.router import MoERouterConfigV2
    from olmo_core.nn.moe.v2.shared_experts import SharedExpertsConfig
    from olmo_core.nn.rope import RoPEConfig, RoPEType
    from olmo_core.nn.transformer import OLMoDDPModelConfig, TransformerBlockType, TransformerType

    norm = LayerNormConfig(name=LayerNormType.rms, eps=1e-6, bias=False, dtype=DType.float32)
    window = None
    if m.attention_window:  # every layer windowed, as the bench's spec has it
        window = SlidingWindowAttentionConfig(pattern=[m.attention_window], force_full_attention_on_first_layer=False,
                                              force_full_attention_on_last_layer=False)
    attention = AttentionConfig(
        name=AttentionType.default, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, bias=False,
        rope=RoPEConfig(name=RoPEType.default, theta=500_000, full_precision=True), qk_norm=norm,
        use_head_qk_norm=True, backend=AttentionBackendName.torch, dtype=DType.float32, sliding_window=window)
    d_routed = m.latent_dim or m.d_model
    r = OLMO_ROUTER
    block = OLMoDDPTransformerBlockConfig(
        name=TransformerBlockType.moe_fused_v2, sequence_mixer=attention, layer_norm=norm,
        routed_experts=RoutedExpertsConfig(d_model=d_routed, hidden_size=m.expert_hidden,
                                           num_experts=m.n_routed_experts, bias=False, dtype=DType.float32),
        routed_experts_router=MoERouterConfigV2(
            d_model=m.d_model, num_experts=m.n_routed_experts, top_k=m.top_k,
            gating_function=MoERouterGatingFunction(r["gating_function"]), lb_loss_weight=r["lb_loss_weight"],
            z_loss_weight=r["z_loss_weight"],
            lb_loss_granularity=MoELoadBalancingLossGranularity(r["lb_loss_granularity"]), dtype=DType.float32,
            normalize_expert_weights=r["normalize_expert_weights"], restore_weight_scale=r["restore_weight_scale"]),
        # n always-on SwiGLU experts summed are one SwiGLU of n times the width (the same parameters
        # and FLOPs); OLMo-core gates several shared experts by a router, which the bench's have not
        shared_experts=(SharedExpertsConfig(d_model=m.d_model, hidden_size=m.n_shared_experts * m.shared_hidden,
                                            num_experts=1, bias=False, dtype=DType.float32)
                        if m.n_shared_experts else None),
        shared_experts_router=None,
        latent_moe=LatentMoEConfig(latent_dim=m.latent_dim) if m.latent_dim else None,
    )
    return OLMoDDPModelConfig(
        d_model=m.d_model, vocab_size=m.vocab_size, n_layers=m.n_layers, block=block,
        lm_head=LMHeadConfig(layer_norm=norm, bias=False, dtype=DType.float32), name=TransformerType.moe_fused_v2,
        dtype=DType.float32, init_seed=0, init_std=0.01, recompute_each_block=False)


class MetricSink:
    """What OLMo-core's train module needs of its Trainer when stepped outside one: somewhere to
    record its metrics (kept as device tensors; read once per step, after the step)."""

    def __init__(self, global_batch_size: int):
        self.metrics: dict[str, Any] = {}
        self.global_step = 0
        self.global_batch_size = global_batch_size
        self.dp_process_group = None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def record_metric(self, name, value, reduce_type=None, namespace=None, merge_strategy=None):
        self.metrics[f"{namespace}/{name}" if namespace else name] = value

    def record_ce_loss(self, value, reduce_type=None):
        self.metrics["train/CE loss"] = value


def olmo_steps(tm, tokens: int, device: str):
    """(launch, read) of one OLMo-core train module stepped outside its Trainer: launch(batch)
    uploads the batch (the bench's host handling for every variant, a pinned upload), runs one
    forward, backward and optimizer step and returns the CE loss as a device tensor; read(loss)
    reads it."""
    sink = MetricSink(tokens)
    tm._attach_trainer(sink)
    tm.zero_grads()  # as its Trainer does before the first step
    dev = torch.device(device)

    def launch(b):
        x = to_device(b, dev)
        sink.global_step += 1
        tm.train_batch({"input_ids": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()})
        tm.optim_step()
        tm.zero_grads()
        return sink.metrics.get("train/CE loss")

    def read(loss):
        return float(loss.detach().float().item())

    return launch, read


def olmo_trainer(spec, device: str, compile_: bool = True):
    """(launch(batch) -> handle, read(handle) -> loss, info): one OLMo-core Trainer step per batch."""
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.optim import OLMoDDPOptimizerConfig, OptimGroupOverride
    from olmo_core.train.train_module import OLMoDDPTrainModuleConfig, TransformerDataParallelConfig

    why = olmo_needs()
    if why:
        raise RuntimeError(why)
    ensure_process_group(device)
    fresh_olmo_world_mesh()
    m, o = spec.model, spec.optim
    S, B = spec.data.seq_len, spec.data.batch_size
    cfg = olmo_model_config(m, S)
    torch.manual_seed(spec.seed)
    model = cfg.build(init_device="meta")
    tm_cfg = OLMoDDPTrainModuleConfig(
        rank_microbatch_size=B * S, max_sequence_length=S,
        optim=OLMoDDPOptimizerConfig(
            lr=o.peak_lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts=dict(weight_decay=0.0))],
            compile=OLMO_TRAIN["optim_compile"] and compile_ and device == "cuda", dtype=DType.float32,
            sigma_factor=OLMO_TRAIN["sigma_factor"], max_grad_norm=o.grad_clip, use_distributed=True),
        compile_model=OLMO_TRAIN["compile_model"] and compile_ and device == "cuda",
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp, reduce_grads_in_fp32=True,
                                                accumulate_grads_in_fp32=True),
        z_loss_multiplier=OLMO_TRAIN["z_loss_multiplier"], max_grad_norm=o.grad_clip)
    tm = tm_cfg.build(model, device=torch.device(device))
    launch, read = olmo_steps(tm, B * S, device)
    info = {"params": sum(p.numel() for p in tm.model_parts[0].parameters()), "config": olmo_settings(m, S),
            "compile": compile_ and device == "cuda"}
    return launch, read, info


def olmo_needs() -> str | None:
    """Why OLMo-core's MoE (OLMoDDPModel) cannot run in this environment, or None."""
    from olmo_core.nn.moe import utils as moe_utils

    if getattr(moe_utils, "moe_permute", None) is None:
        return ("OLMo-core 3's MoE (OLMoDDPModel, its no-expert-parallel path) permutes and unpermutes "
                "tokens with Transformer Engine's moe_permute/moe_unpermute, and Transformer Engine is "
                "not importable: transformer_engine_torch has no binary wheel (it is compiled against "
                "the installed torch with nvcc) and transformer_engine_cu13 2.20.2 alone is 276.5 MB, "
                "more than travels to the GPU machine")
    return None


def olmo_v1_settings(m, seq: int) -> dict:
    return {"package": "ai2-olmo-core 3.0.0", "model": "TransformerConfig.llama_like_moe (its first MoE, "
            "MoEType.default: MoEMLP experts by torch.bmm over capacity buffers)",
            "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "vocab_size": m.vocab_size, "num_experts": m.n_routed_experts,
            "top_k": m.top_k, "expert_hidden": m.expert_hidden, "seq": seq,
            "dispatch": f"capacity factor {OLMO_V1['capacity_factor']} (tokens over it dropped)",
            "why_not_dropless": "MoEType.dropless needs the grouped_gemm CUDA extension (source only, "
                                "compiled with nvcc against torch); without it OLMo-core loops over "
                                "the experts in Python with a host sync a layer",
            **OLMO_V1}


OLMO_V1 = {"capacity_factor": 1.25, "block": "moe_reordered_norm (OLMoE: QK-norm, reordered norms)",
           "compile_model": True, "dp": "FSDP over one rank, param bf16, reduce fp32",
           "optimizer": "AdamWConfig(fused=True, betas=(0.9, 0.95), weight_decay=0.1, no decay on embeddings)",
           "lb_loss_weight": 0.01, "z_loss_weight": 0.001, "z_loss_multiplier": 1e-5, "max_grad_norm": 1.0,
           "attention_backend": "torch (SDPA)"}


def fresh_olmo_world_mesh() -> None:
    """OLMo-core builds one world mesh a process and refuses a second; a bench that builds its
    train module again (--repeat) starts from none, on the same one-rank process group."""
    from olmo_core.distributed import parallel

    parallel._WORLD_MESH = None


def wait_for_build(timeout_s: float = 900.0) -> None:
    """Wait for bench/peers_setup.sh's background grouped_gemm build, where it is under way
    ($GG_DONE names the file it writes when the build ends, with the build's exit status)."""
    done = os.environ.get("GG_DONE")
    if not done:
        return
    t0 = time.monotonic()
    while not os.path.exists(done) and time.monotonic() - t0 < timeout_s:
        time.sleep(2.0)
    status = open(done).read().strip() if os.path.exists(done) else "not finished"
    print(f"grouped_gemm build: exit {status} after waiting {time.monotonic() - t0:.0f}s", flush=True)


def olmo_v1_trainer(spec, device: str, compile_: bool = True, dropless: bool = False):
    """(launch, read, info): OLMo-core's first MoE (capacity experts, or with `dropless` its
    dropless experts through the grouped_gemm extension, as its MoE docs recommend) through its
    TransformerTrainModule at the settings of its OLMoE recipe, where they can run here."""
    if dropless:
        wait_for_build()
        import grouped_gemm  # noqa: F401  (pip install grouped_gemm: compiled with nvcc against torch)
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.attention.backend import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, OptimGroupOverride
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    ensure_process_group(device)
    fresh_olmo_world_mesh()
    m, o = spec.model, spec.optim
    S, B = spec.data.seq_len, spec.data.batch_size
    cfg = TransformerConfig.llama_like_moe(
        d_model=m.d_model, vocab_size=m.vocab_size, n_layers=m.n_layers, n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, num_experts=m.n_routed_experts, top_k=m.top_k,
        expert_hidden_size=m.expert_hidden, dropless=dropless,
        capacity_factor=None if dropless else OLMO_V1["capacity_factor"],
        lb_loss_weight=OLMO_V1["lb_loss_weight"], z_loss_weight=OLMO_V1["z_loss_weight"], reordered_norm=True,
        attn_backend=AttentionBackendName.torch)
    torch.manual_seed(spec.seed)
    model = cfg.build(init_device="meta")
    tm = TransformerTrainModuleConfig(
        rank_microbatch_size=B * S, max_sequence_length=S,
        optim=AdamWConfig(lr=o.peak_lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                          fused=device == "cuda",
                          group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                                              opts=dict(weight_decay=0.0))]),
        compile_model=OLMO_V1["compile_model"] and compile_ and device == "cuda",
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp, param_dtype=DType.bfloat16,
                                                reduce_dtype=DType.float32),
        z_loss_multiplier=OLMO_V1["z_loss_multiplier"], max_grad_norm=o.grad_clip,
    ).build(model, device=torch.device(device))
    launch, read = olmo_steps(tm, B * S, device)
    config = olmo_v1_settings(m, S)
    if dropless:
        config["dispatch"] = "dropless (MoEType.dropless: grouped_gemm.ops.gmm over the tokens sorted by expert)"
        config["model"] = ("TransformerConfig.llama_like_moe(dropless=True) (its first MoE, MoEType.dropless: "
                           "experts by grouped_gemm, built in CUTLASS mode as its image builds it)")
        config.pop("why_not_dropless")
        config.pop("capacity_factor")
    info = {"params": int(cfg.num_params), "config": config, "compile": compile_ and device == "cuda",
            "num_flops_per_token": int(tm.model.num_flops_per_token(S))}
    return launch, read, info


# ---- torchtitan -----------------------------------------------------------------------------------


def titan_version() -> str:
    """The installed torchtitan's version ("0.3.0", "0.2.2", ...); its API changed at 0.3."""
    from importlib.metadata import version

    import torchtitan  # noqa: F401 - not installed: ModuleNotFoundError, as for the other peers

    return version("torchtitan")


def titan_generation(version: str) -> str:
    """"0.3" for 0.3 and later (Config-object models, ChunkedLossWrapper, CUDA graphs), "0.2" for
    the 0.2 releases (model-args dataclasses, JobConfig, one GPU under AMP)."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return "0.3" if (major, minor) >= (0, 3) else "0.2"


def titan_settings(m, seq: int, version: str | None = None) -> dict:
    version = version or titan_version()
    gen = titan_generation(version)
    out = {"package": f"torchtitan {version}", "model": "Qwen3Model (torchtitan.models.qwen3, MoE layers)",
           "d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
           "head_dim": m.head_dim, "vocab_size": m.vocab_size, "num_experts": m.n_routed_experts,
           "top_k": m.top_k, "expert_hidden": m.expert_hidden, "seq": seq,
           "sliding_window": None, "latent_dim": None, "shared_experts": 0,
           "dispatch": ("dropless (LocalTokenDispatcher; no capacity on one GPU)" if gen == "0.3" else
                        "dropless (TokenReorderer and GroupedExperts; no capacity in its MoE)"),
           **(TITAN_TRAIN if gen == "0.3" else TITAN2_TRAIN)}
    missing = [f for f, v in (("latent projection", m.latent_dim), ("shared experts", m.n_shared_experts),
                              ("sliding window", m.attention_window)) if v]
    if missing:  # Qwen3's MoE flavors have none of these; the peer runs without them (fewer FLOPs a token)
        out["not_in_qwen3"] = missing
    return out


def titan_trainer(spec, device: str, cuda_graphs: bool = True, compile_: bool = True):
    """(launch, read, info): torchtitan's Trainer.train_step per batch, by the installed release's
    API (0.3 and later, or 0.2)."""
    if titan_generation(titan_version()) == "0.3":
        return titan3_trainer(spec, device, cuda_graphs=cuda_graphs, compile_=compile_)
    return titan2_trainer(spec, device, compile_=compile_)


def titan_meta(m, seq: int) -> dict:
    """torchtitan's Qwen3 MoE built on the meta device: its parameters and its FLOPs a token."""
    if titan_generation(titan_version()) == "0.3":
        cfg = titan_model_config(m, seq)
        with torch.device("meta"):
            model = cfg.build()
        n, f = cfg.get_nparams_and_flops(model, seq)
    else:
        from torchtitan.models.qwen3 import Qwen3Model

        args = titan2_model_args(m, seq)
        with torch.device("meta"):
            model = Qwen3Model(args)
        n, f = args.get_nparams_and_flops(model, seq)
    return {"params": sum(p.numel() for p in model.parameters()), "num_params": int(n),
            "num_flops_per_token": int(f), "version": titan_version()}


# torchtitan 0.2 (0.2.2 is the last release before 0.3, whose FSDP imports torch.distributed.fsdp's
# DataParallelMeshDims, which torch 2.11 lacks). Its Trainer on one GPU: ParallelDims with every
# degree 1 enables no FSDP, so the model keeps fp32 parameters and its forward runs under bf16
# autocast (distributed.utils.maybe_enable_amp); no CUDA graphs (0.3 added them).
TITAN2_TRAIN = {"compile": "enable=True, components=[model, loss] (per-block torch.compile, fullgraph; in MoE "
                           "blocks the attention, norms and router compiled, the grouped experts eager)",
                "attention_backend": "sdpa (Qwen3ModelArgs.attn_type default, causal; SDPA backends in the "
                                     "order cuDNN, flash, math)",
                "cuda_graphs": "none (torchtitan 0.2 has no CUDA graph capture)",
                "precision": "one GPU without FSDP (every parallel degree 1): fp32 parameters, bf16 autocast "
                             "(maybe_enable_amp, mixed_precision_param=bfloat16)",
                "optimizer": "build_optimizers: AdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)",
                "loss": "build_cross_entropy_loss: cross_entropy(sum) in fp32 over the full logits, over the "
                        "valid tokens (compiled)", "max_norm": 1.0,
                "activation_checkpoint": "none (one GPU with memory to spare)",
                "moe": "MoEArgs as its Qwen3-MoE flavors (softmax, route_norm=True, route_scale=1.0, "
                       "score_before_experts=False, no shared experts, load_balance_coeff=1e-3): "
                       "TokenChoiceTopKRouter, GroupedExperts through torch._grouped_mm (use_grouped_mm=True), "
                       "no EP",
                "lr_schedule": "none built (its warm-up schedule changes no kernel)"}


def titan2_model_args(m, seq: int):
    """torchtitan 0.2's Qwen3ModelArgs at the bench's shape, MoE arguments as its 30B-A3B flavor."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        vocab_size=m.vocab_size, max_seq_len=seq, head_dim=m.head_dim, dim=m.d_model, n_layers=m.n_layers,
        n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, qk_norm=True, hidden_dim=m.expert_hidden, rope_theta=1000000,
        moe_enabled=True, moe_inter_dim=m.expert_hidden,
        moe_args=MoEArgs(num_experts=m.n_routed_experts, num_shared_experts=0, top_k=m.top_k, score_func="softmax",
                         route_norm=True, route_scale=1.0, score_before_experts=False))


def titan2_trainer(spec, device: str, compile_: bool = True):
    """(launch, read, info): torchtitan 0.2's Trainer.train_step per batch, its model built,
    parallelised and initialised as its Trainer.__init__ does on one GPU."""
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

    ensure_process_group(device)
    m, o = spec.model, spec.optim
    S, B = spec.data.seq_len, spec.data.batch_size
    job = JobConfig()  # its defaults, then the bench's batch and learning rate
    job.job.dump_folder = "/tmp/torchtitan_bench"
    job.training.local_batch_size, job.training.seq_len, job.training.max_norm = B, S, o.grad_clip
    job.compile.enable = compile_ and device == "cuda"
    job.compile.components = ["model", "loss"]
    job.activation_checkpoint.mode = "none"
    job.optimizer.lr = o.peak_lr
    p = job.parallelism
    parallel_dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                                 cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                                 pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                                 etp=p.expert_tensor_parallel_degree, world_size=1)
    args = titan2_model_args(m, S)
    args.update_from_config(job)
    torch.manual_seed(spec.seed)
    with torch.device("meta"):
        model = Qwen3Model(args)  # training.dtype is float32, torch's default
    n_params, flops = args.get_nparams_and_flops(model, S)
    loss_fn = build_cross_entropy_loss(job)
    model = parallelize_qwen3(model, parallel_dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = build_optimizers([model], job.optimizer, parallel_dims)
    train_context = dist_utils.get_train_context(False)  # no loss parallel without TP
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, device)
    dev = torch.device(device)

    def launch(b):  # Trainer.train_step and forward_backward_step (one microbatch, no PP)
        optimizers.zero_grad()
        x = to_device(b, dev)  # the bench's host handling for every variant (pinned upload)
        inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        global_valid_tokens = (labels != IGNORE_INDEX).sum().float()
        with train_context():
            with amp:
                pred = model(inputs)  # sdpa: no attention masks, positions from 0
                loss = loss_fn(pred, labels) / global_valid_tokens
            del pred
            loss.backward()
        dist_utils.clip_grad_norm_([q for q in model.parameters()], job.training.max_norm, foreach=True,
                                   pp_mesh=None, ep_enabled=False)
        optimizers.step()
        return loss.detach()

    def read(loss):
        return float(loss.float().item())

    info = {"params": n_params, "num_flops_per_token": int(flops), "config": titan_settings(m, S),
            "cuda_graphs": False, "compile": job.compile.enable}
    return launch, read, info


# torchtitan 0.3: model Config objects, FSDP2 over one rank, ChunkedLossWrapper, CUDA graphs.


def titan_model_config(m, seq: int):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _EMBEDDING_INIT, _LINEAR_INIT, _qwen3_norm

    return Qwen3Model.Config(
        vocab_size=m.vocab_size, dim=m.d_model, norm=_qwen3_norm(m.d_model),
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.d_model,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=m.d_model, out_features=m.vocab_size, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=m.n_layers, dim=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            head_dim=m.head_dim, moe_hidden_dim=m.expert_hidden, num_experts=m.n_routed_experts, top_k=m.top_k,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=m.head_dim, max_seq_len=seq, theta=1000000.0)))


def titan3_trainer(spec, device: str, cuda_graphs: bool = True, compile_: bool = True):
    """(launch, read, info): torchtitan 0.3's Trainer.train_step per batch, its model built and
    parallelised as its Trainer.__init__ does."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig  # noqa: F401
    from torchtitan.models.qwen3 import parallelize_qwen3

    ensure_process_group(device)
    m, o = spec.model, spec.optim
    S, B = spec.data.seq_len, spec.data.batch_size
    training = TrainingConfig(local_batch_size=B, seq_len=S, max_norm=o.grad_clip,
                              disable_cuda_graphs=not (cuda_graphs and device == "cuda"))
    parallelism = ParallelismConfig()
    compile_cfg = CompileConfig(enable=compile_ and device == "cuda")
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    model_cfg = titan_model_config(m, S)

    from torchtitan.trainer import Trainer

    # its Trainer.Config with the bench's batch (no data, tokenizer or checkpoint is built from it)
    run_cfg = Trainer.Config(training=training, parallelism=parallelism, compile=compile_cfg)
    model_cfg.update_from_config(config=run_cfg)
    torch.manual_seed(spec.seed)
    with torch.device("meta"):
        model = model_cfg.build()
    n_params, flops = model_cfg.get_nparams_and_flops(model, S)
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=m.vocab_size)).build(
        compile_config=run_cfg.compile)
    model = parallelize_qwen3(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=compile_cfg, ac_config=None, dump_folder="/tmp/torchtitan_bench")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    opt_cfg = default_adamw(lr=o.peak_lr)
    optimizers = opt_cfg.build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)
    ctx = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    def body(inputs, labels, global_valid_tokens, extra_kwargs):  # Trainer._forward_backward_body
        with ctx():
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra_kwargs["positions"])
            del pred
            loss.backward()
        return loss

    fwd_bwd = body
    if not training.disable_cuda_graphs:
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

        fwd_bwd = wrap_with_cuda_graph(body)
    dev = torch.device(device)
    positions_host = torch.arange(S).unsqueeze(0).expand(B, S).contiguous()  # one document a row

    def launch(b):  # Trainer.train_step with post_dataloading_process
        optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
        x = to_device(b, dev)  # the bench's host handling for every variant (pinned upload)
        inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        gvt = (labels != -100).sum()
        extra = {"positions": positions_host.to(dev)}
        extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
        if parallelism.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, extra = annotate_input_spmd_types(parallel_dims, inputs, labels, extra)
        loss = fwd_bwd(inputs, labels, gvt, extra).detach().clone()
        dist_utils.clip_grad_norm_([p for p in model.parameters()], training.max_norm, foreach=True,
                                   pp_mesh=None, ep_enabled=False)
        optimizers.step()
        return loss

    def read(loss):
        return float(loss.float().item())  # sum loss / valid tokens of the batch = the mean

    info = {"params": n_params, "num_flops_per_token": int(flops), "config": titan_settings(m, S, titan_version()),
            "cuda_graphs": not training.disable_cuda_graphs, "compile": compile_cfg.enable}
    return launch, read, info


# ---- shapes on the meta device ---------------------------------------------------------------------


def ours_params(m) -> int:
    """Parameters of the bench's model by the shape's own count (core.costs)."""
    return int(param_counts(m)["total"])


def meta_shapes(spec) -> dict:
    """Each peer built on the meta device at spec's shape: total parameters and its own FLOPs a
    token, beside the bench's (core.costs); needs no GPU and no process group."""
    m, S = spec.model, spec.data.seq_len
    out: dict = {"ours_params": ours_params(m)}
    try:
        cfg = olmo_model_config(m, S)
        with torch.device("meta"):
            model = cfg.build(init_device="meta")
        out["olmo-core"] = {"params": sum(p.numel() for p in model.parameters()),
                            "config_num_params": int(cfg.num_params),
                            "num_flops_per_token": int(model.num_flops_per_token(S))}
    except Exception as err:  # noqa: BLE001 - reported, not raised: a shape a peer cannot build
        out["olmo-core"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    try:
        from olmo_core.nn.transformer import TransformerConfig

        cfg = TransformerConfig.llama_like_moe(
            d_model=m.d_model, vocab_size=m.vocab_size, n_layers=m.n_layers, n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads, head_dim=m.head_dim, num_experts=m.n_routed_experts, top_k=m.top_k,
            expert_hidden_size=m.expert_hidden, dropless=False, capacity_factor=OLMO_V1["capacity_factor"],
            reordered_norm=True)
        with torch.device("meta"):
            model = cfg.build(init_device="meta")
        out["olmo-core_v1"] = {"params": sum(p.numel() for p in model.parameters()),
                               "num_flops_per_token": int(model.num_flops_per_token(S))}
    except Exception as err:  # noqa: BLE001
        out["olmo-core_v1"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    try:
        out["torchtitan"] = titan_meta(m, S)
    except Exception as err:  # noqa: BLE001
        out["torchtitan"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    return out


def expected_param_delta(m) -> dict:
    """Parameters each peer has that the bench's model has not, or the other way round, at equal
    shape: norms (per-head QK-norm weights, the final norm) and what its builder lacks."""
    return {"olmo-core": "QK-norm weights (2 x heads x head_dim a layer) and norms",
            "torchtitan": "QK-norm weights (2 x head_dim a layer); no latent/shared experts if the shape has them"}


def finite(x: float) -> bool:
    return math.isfinite(x)
