"""Expert parallel over real processes (gloo on the CPU) against the single-process engine,
which emulates the same EP shards on one device: the same losses, gradient norms and drop
counts at every step, and the same weights at the end.

The 2-rank run starts under torchrun (the documented command) and stops half-way; the other
runs (its continuation, 4 ranks, dropless over 2 ranks) are forked from one driver process,
which saves the torch import per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.data import EVAL_ROWS, TokenStream

from engines.base import read_metrics, read_status
from engines.checkpoint import latest_checkpoint, load_checkpoint
from engines.torch.parallel.checkpoint import latest_sharded, read_full
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec
from core.spec import save_spec
from tests.engines.fork_ranks import cpu_env, drive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# init_std 0.3: the routed experts move the loss well beyond the tolerances below (at the preset's
# 0.02 their output is lost in fp32 rounding, and a loss comparison would not see them)
COMMON = {"model.n_waves": 2, "model.capacity_factor_send": 1.0, "model.capacity_factor_recv": 1.0,
          "model.init_std": 0.3, "data.total_tokens": 6 * 64 * 8, "run.eval_every": 3, "run.checkpoint_every": 3}
# softmax router, batch-scope balancing and the balancing bias (updated from global loads)
TWO = {"model.ep_size": 2, "model.router_bias_balancing": True, "model.router_bias_rate": 0.01}
SPECS = {
    "ep2": micro_spec("ep2", **COMMON, **TWO, **{"model.dispatch": "capacity"}),
    # sigmoid router, sequence-scope balancing, no latent, 4 ranks of 2 experts each
    "ep4": micro_spec("ep4", **COMMON, **{"model.ep_size": 4, "model.dispatch": "capacity",
                                           "model.router_kind": "sigmoid", "model.balance_scope": "sequence",
                                           "model.latent_dim": None}),
    "dropless2": micro_spec("dropless2", **COMMON, **TWO, **{"model.dispatch": "dropless"}),
}

def _train_args(spec_path: Path, run_dir: Path, *extra: str) -> list[str]:
    return [str(spec_path), "--run-dir", str(run_dir), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    out = {}
    for name, spec in SPECS.items():
        save_spec(spec, root / f"{name}.yaml")
        list(TorchEngine("cpu").train(spec, root / f"{name}-single"))  # also fills the token cache
    # 2 ranks under torchrun, stopped after step 3 ...
    proc = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "engines.torch.parallel.train",
         *_train_args(root / "ep2.yaml", root / "ep2-ranks", "--steps", "3")],
        cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out["ep2_status_at_stop"] = read_status(root / "ep2-ranks")
    # ... then continued from its checkpoint; 4 ranks; dropless over 2 ranks
    jobs = [[2, _train_args(root / "ep2.yaml", root / "ep2-ranks")],
            [4, _train_args(root / "ep4.yaml", root / "ep4-ranks")],
            [2, _train_args(root / "dropless2.yaml", root / "dropless2-ranks", "--profile", str(root / "prof"))]]
    assert drive("engines.torch.parallel.train", jobs, join_s=120, timeout=300) == [[0, 0], [0, 0, 0, 0], [0, 0]]
    out["root"] = root
    return out


def _curves(root: Path, name: str):
    return read_metrics(root / f"{name}-single"), read_metrics(root / f"{name}-ranks")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_ranks_give_the_single_process_losses_and_gradient_norms(runs, name):
    single, ranks = _curves(runs["root"], name)
    assert [r["step"] for r in ranks] == list(range(6))
    for key in ("loss", "grad_norm", "aux_loss", "z_loss", "router_entropy", "expert_load_max"):
        np.testing.assert_allclose([r[key] for r in ranks], [r[key] for r in single], rtol=2e-5, err_msg=key)
    for key in ("router_z_loss", "total_loss"):
        np.testing.assert_allclose([r["extra"][key] for r in ranks], [r["extra"][key] for r in single],
                                   rtol=2e-5, err_msg=key)
    np.testing.assert_allclose([r["eval_loss"] for r in ranks if r["eval_loss"] is not None],
                               [r["eval_loss"] for r in single if r["eval_loss"] is not None], rtol=2e-5)


@pytest.mark.parametrize("name", ["ep2", "ep4"])
def test_ranks_drop_exactly_what_the_emulated_shards_drop(runs, name):
    single, ranks = _curves(runs["root"], name)
    for key in ("drop_frac_send", "drop_frac_recv"):
        assert [r[key] for r in ranks] == [r[key] for r in single], key
        # capacity factors of 1: both bounds bite, so the equality is not vacuous
        assert all(r[key] > 0 for r in single), key


def test_the_drops_move_the_loss_far_beyond_the_tolerance(runs):
    capacity, _ = _curves(runs["root"], "ep2")
    dropless, _ = _curves(runs["root"], "dropless2")  # the same spec without drops
    gap = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(capacity, dropless))
    assert gap > 50 * 2e-5


def test_dropless_over_ranks_drops_nothing(runs):
    _, ranks = _curves(runs["root"], "dropless2")
    assert all(r["drop_frac_send"] == 0 and r["drop_frac_recv"] == 0 for r in ranks)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_gathered_checkpoint_holds_the_single_process_weights(runs, name):
    root = runs["root"]
    ref_path, ep_path = latest_checkpoint(root / f"{name}-single"), latest_sharded(root / f"{name}-ranks")
    assert ref_path.name == ep_path.name == "step_00000006"
    ref, ref_opt, _ = load_checkpoint(ref_path)
    got, got_opt, info = read_full(ep_path)
    assert info["mesh"] == {"dp": 1, "ep": SPECS[name].model.ep_size, "world": SPECS[name].model.ep_size}
    assert sorted(got) == sorted(ref)
    spec = SPECS[name]
    steps = spec.data.total_tokens // (spec.data.batch_size * spec.data.seq_len)
    # Adam scales each element's step to about lr, so another fp32 summation order (a gradient
    # element sums 512 token terms, 256 + 256 over the ranks: relative error ~512 * 2**-24 = 3e-5,
    # more where the terms cancel) moves a weight by a small fraction of lr per step, whatever the
    # weight's size: allow 1% of the peak lr a step (1.8e-4 over 6 steps; seen: 2.4e-6, 8e-4 lr). A
    # missing gradient reduction moves weights by ~5 lr (1.5e-2, 80x this), a wrong shard by the
    # weights' own scale (~0.3, 1,500x).
    atol = 0.01 * spec.optim.peak_lr * steps
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=atol, err_msg=k)
    for k in ("m/blocks.1.moe.experts.w_up", "v/blocks.0.moe.router"):
        # a moment carries its gradients' rounding (3e-5 relative, above): 1e-3 relative, and for an
        # element whose terms cancel to near zero 1e-4 of the tensor's largest (seen: up to 1e-6 of
        # it; the gradients of half the batch, a missing reduction, move it by 0.3 of it)
        np.testing.assert_allclose(got_opt[k], ref_opt[k], rtol=1e-3, atol=1e-4 * np.abs(ref_opt[k]).max(),
                                   err_msg=k)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_rank_holds_only_its_experts_and_exchanges_rows(runs, name):
    spec = SPECS[name]
    m = spec.model
    summary = json.loads((runs["root"] / f"{name}-ranks" / "mesh.json").read_text())
    assert summary["world_size"] == m.ep_size and summary["backend"] == "gloo"
    per = m.n_routed_experts // m.ep_size
    assert [r["experts"] for r in summary["ranks"]] == [[i * per, (i + 1) * per] for i in range(m.ep_size)]
    assert all(set(r["expert_rows"].values()) == {per} for r in summary["ranks"])
    # per layer and forward or backward: one all-to-all per wave each way (capacity), or the
    # counts plus two ragged exchanges forward and two backward (dropless)
    first, steps = summary["first_step"], summary["steps"]
    stream = TokenStream.from_spec(spec)  # an eval forward per batch of the fixed eval set's plan
    periodic, every = (len(stream.eval_plan(spec.run.eval_batches * EVAL_ROWS)), len(stream.eval_plan(None)))
    # the final eval scores the periodic sample and then every window (once when they are the same)
    final = periodic + every if every != periodic else every
    evals = sum(final if done == spec.total_steps else periodic for done in range(first + 1, first + steps + 1)
                if done % spec.run.eval_every == 0 or done == spec.total_steps)
    per_layer = (2 * m.n_waves * (2 * steps + evals) if m.dispatch == "capacity" else 5 * steps + 3 * evals)
    assert all(r["all_to_all_calls"] == per_layer * m.n_layers for r in summary["ranks"])


def test_a_run_stopped_early_is_left_resumable_and_the_continuation_finishes(runs):
    stopped = runs["ep2_status_at_stop"]
    assert stopped["state"] == "running" and stopped["stopped_at"] == 3
    assert stopped["last_checkpoint"].endswith("step_00000003")
    assert read_status(runs["root"] / "ep2-ranks")["state"] == "finished"


def test_a_process_count_other_than_ep_size_is_a_clear_error(runs, tmp_path):
    proc = subprocess.run([PY, "-m", "engines.torch.parallel.train",
                           *_train_args(runs["root"] / "ep2.yaml", tmp_path / "run")],
                          cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "1 process(es) do not form a (data x expert) mesh with model.ep_size 2" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_batch_that_does_not_split_into_whole_sequences_per_rank_is_refused():
    from engines.torch.parallel.layout import LayoutError, check_layout

    spec = micro_spec(**{"model.ep_size": 4, "data.batch_size": 6})
    with pytest.raises(LayoutError, match=r"data.batch_size \(6\) must be a multiple of the 4 processes"):
        check_layout(spec.model, 4, spec.data.batch_size)


def test_row_gather_backward_is_the_index_backward():
    """The capacity dispatch's gathers: many output rows read the zero row, each input row is
    read at most once, and the backward by the partial inverse equals aten's x[idx] backward."""
    import torch

    from engines.torch.rows import RowGather

    gen = torch.Generator().manual_seed(0)
    N, M, L = 7, 12, 5
    readers = torch.randperm(M, generator=gen)[:5]  # 5 output rows read x rows 0..4; rows 5, 6 unread
    idx_M = torch.full((M,), N, dtype=torch.long)
    idx_M[readers] = torch.arange(5)
    inv_N = torch.full((N + 1,), M, dtype=torch.long).scatter_(0, idx_M, torch.arange(M))[:N]
    x_NL = torch.randn(N, L, generator=gen, requires_grad=True)
    g_ML = torch.randn(M, L, generator=gen)
    y_ML = RowGather.apply(x_NL, idx_M, inv_N)
    (grad,) = torch.autograd.grad(y_ML, x_NL, g_ML)
    x_ref = x_NL.detach().clone().requires_grad_(True)
    y_ref = torch.cat([x_ref, x_ref.new_zeros(1, L)])[idx_M]
    (grad_ref,) = torch.autograd.grad(y_ref, x_ref, g_ML)
    assert torch.equal(y_ML, y_ref)
    assert torch.equal(grad, grad_ref)
    assert grad[5:].abs().sum() == 0 and grad[:5].abs().sum() > 0


def test_profile_writes_each_ranks_operator_table(runs):
    for rank in (0, 1):
        text = (runs["root"] / f"prof.rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank}: ") and "ms per step over 2 steps" in text
        assert "alltoall" in text  # the ragged exchange of the profiled steps
