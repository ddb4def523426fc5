"""MasterAdamW's update on a stream of its own (update_stream "side"): each stage of the update
overlaps the forward of the stage before, and the run is the same bit for bit as with the update
on the main stream, through the engine's look-ahead loop, its evaluations and its checkpoints.
Skipped without CUDA."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from engines.checkpoint import latest_checkpoint, load_checkpoint
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = micro_spec(**{
    "model.d_model": 256, "model.n_heads": 4, "model.n_kv_heads": 4, "model.head_dim": 64,
    "model.n_routed_experts": 8, "model.top_k": 2, "model.expert_hidden": 128, "model.ep_size": 1,
    "data.seq_len": 256, "data.batch_size": 4, "data.total_tokens": 256 * 4 * 9,
    "run.eval_every": 4, "run.checkpoint_every": 3})


def _run(monkeypatch, tmp_path, stream):
    from engines.torch import fast

    # CUDA graphs (the GPU default) cannot take the side stream; both runs go without them
    monkeypatch.setattr(fast, "OPTIONS", dataclasses.replace(fast.OPTIONS, compile="block"))
    monkeypatch.setenv("MOE_LADDER_TORCH_UPDATE_STREAM", stream)
    monkeypatch.setenv("MOE_LADDER_TORCH_MASTER", "1")
    run_dir = tmp_path / stream
    list(TorchEngine("cuda").train(SPEC, run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    params, opt, info = load_checkpoint(latest_checkpoint(run_dir))
    return rows, params, opt, info


def test_the_side_stream_update_trains_bit_for_bit_like_the_main_stream(monkeypatch, tmp_path):
    main_rows, main_params, main_opt, _ = _run(monkeypatch, tmp_path, "main")
    side_rows, side_params, side_opt, info = _run(monkeypatch, tmp_path, "side")
    assert info["step"] == SPEC.total_steps and len(side_rows) == len(main_rows) == SPEC.total_steps
    for a, b in zip(main_rows, side_rows):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert sum(r["eval_loss"] is not None for r in side_rows) >= 2  # evaluations read the state mid-run
    for name in main_params:
        np.testing.assert_array_equal(side_params[name], main_params[name], err_msg=name)
    for name in main_opt:
        np.testing.assert_array_equal(side_opt[name], main_opt[name], err_msg=name)


def test_cuda_graphs_refuse_the_side_stream_update():
    from engines.torch.engine import build_optimizer
    from engines.torch.fast import FastLoss, FastOptions
    from engines.torch.master import MasterAdamW
    from engines.torch.model import MoETransformer

    model = MoETransformer(SPEC.model).cuda()
    plain = build_optimizer(model, SPEC, working=False)
    opt = MasterAdamW(model, plain.param_groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, update_stream="side")
    with pytest.raises(ValueError, match="block-cudagraphs.*update_stream 'side'"):
        FastLoss(model, torch.device("cuda"), FastOptions(compile="block-cudagraphs"), working=opt)
