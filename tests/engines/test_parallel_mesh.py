"""A (data x expert) layout of real processes (gloo on the CPU) against the one-device engine,
which emulates the spec's expert shards: dp2 x ep2 over 4 processes gives its losses, gradient
norms and drops at every step, and its weights at the end; a run resumes from its sharded
checkpoint to the bit; a sharded checkpoint exports to the engine-neutral format, and 2 processes
(dp1 x ep2) continue from the export.

The 4-process runs are forked from one driver process, which saves the torch import per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.base import read_metrics, read_status
from engines.checkpoint import init_from_checkpoint, latest_checkpoint, load_checkpoint
from engines.torch.parallel.checkpoint import export, latest_sharded, read_full
from engines.torch.parallel.layout import Layout
from engines.torch.engine import TorchEngine
from ladder.presets import micro_spec
from core.spec import save_spec
from tests.engines.fork_ranks import cpu_env, drive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# capacity factors of 1 and init_std 0.3 (as tests/engines/test_torch_ep.py): both drop bounds
# bite, and the routed experts move the loss well beyond the tolerances
SPEC = micro_spec("mesh", **{"model.ep_size": 2, "model.dispatch": "capacity", "model.n_waves": 2,
                             "model.capacity_factor_send": 1.0, "model.capacity_factor_recv": 1.0,
                             "model.init_std": 0.3, "model.router_bias_balancing": True,
                             "model.router_bias_rate": 0.01, "data.total_tokens": 6 * 64 * 8,
                             "run.eval_every": 3, "run.checkpoint_every": 3})

# the same spec with dropless dispatch: the ragged all-to-all over each data row
DROPLESS = SPEC.replace(name="dropless", **{"model.dispatch": "dropless"})
# and with every expert on every rank (ep 1): data parallel only, no exchange (dp2 x ep1)
DATA_PARALLEL = DROPLESS.replace(name="dataparallel", **{"model.ep_size": 1})

def _args(root: Path, run: str, *extra: str) -> list[str]:
    return [str(root / "mesh.yaml"), "--run-dir", str(root / run), "--device", "cpu", *extra]


def _drive(jobs: list) -> list:
    return drive("engines.torch.parallel.train", jobs, join_s=240, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    save_spec(SPEC, root / "mesh.yaml")
    save_spec(DROPLESS, root / "dropless.yaml")
    save_spec(DATA_PARALLEL, root / "dataparallel.yaml")
    list(TorchEngine("cpu").train(SPEC, root / "single"))  # also fills the token cache
    list(TorchEngine("cpu").train(DROPLESS, root / "dropless-single"))
    list(TorchEngine("cpu").train(DATA_PARALLEL, root / "dataparallel-single"))
    # dp2 x ep2 in one go; the same stopped after step 3, then continued on the same mesh; dropless;
    # dp2 x ep1
    dropless = [str(root / "dropless.yaml"), "--run-dir", str(root / "dropless4"), "--device", "cpu"]
    dataparallel = [str(root / "dataparallel.yaml"), "--run-dir", str(root / "dataparallel2"), "--device", "cpu"]
    # then the stopped run's step-3 shards exported (in the driver), and dp1 x ep2 continuing from
    # the export alone: one driver, one torch import, for all of it
    codes = _drive([[4, _args(root, "full4")], [4, _args(root, "half4", "--steps", "3")],
                    [4, _args(root, "half4")], [4, dropless], [2, dataparallel],
                    ["call", f"{__name__}:export_half", [str(root)]], [2, _args(root, "from_export2")]])
    assert codes == [[0] * 4] * 4 + [[0, 0], "called", [0, 0]]
    return root


def export_half(root: str) -> None:
    """The stopped run's step-3 shards exported, and a run directory that starts from the export."""
    exported = export(Path(root) / "half4", step=3)
    init_from_checkpoint(Path(root) / "from_export2", exported, metrics_from=Path(root) / "half4")


def test_dp2_ep2_gives_the_single_process_losses_and_gradient_norms(runs):
    single, mesh = read_metrics(runs / "single"), read_metrics(runs / "full4")
    assert [r["step"] for r in mesh] == list(range(6))
    for key in ("loss", "grad_norm", "aux_loss", "z_loss", "router_entropy", "expert_load_max"):
        np.testing.assert_allclose([r[key] for r in mesh], [r[key] for r in single], rtol=2e-5, err_msg=key)
    for key in ("router_z_loss", "total_loss"):
        np.testing.assert_allclose([r["extra"][key] for r in mesh], [r["extra"][key] for r in single],
                                   rtol=2e-5, err_msg=key)
    np.testing.assert_allclose([r["eval_loss"] for r in mesh if r["eval_loss"] is not None],
                               [r["eval_loss"] for r in single if r["eval_loss"] is not None], rtol=2e-5)


def test_dp2_ep2_drops_exactly_what_the_emulated_shards_drop(runs):
    single, mesh = read_metrics(runs / "single"), read_metrics(runs / "full4")
    for key in ("drop_frac_send", "drop_frac_recv"):
        assert [r[key] for r in mesh] == [r[key] for r in single], key
        assert all(r[key] > 0 for r in single), key  # both bounds bite: the equality is not vacuous


def test_the_exported_final_shards_hold_the_single_process_weights(runs):
    ref, ref_opt, _ = load_checkpoint(latest_checkpoint(runs / "single"))
    got, got_opt, state = read_full(latest_sharded(runs / "full4"))
    assert state["step"] == 6 and state["mesh"] == {"dp": 2, "ep": 2, "world": 4}
    assert sorted(got) == sorted(ref)
    for k in ref:  # AdamW turns an expert's near-zero gradient, summed over the data ranks in
        # another order, into up to ~1% of one update (3e-3): atol 5e-5
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=5e-5, err_msg=k)
    assert int(got_opt["step"]) == int(ref_opt["step"]) == 6
    # the ranks run the sharded objective, the one-process CPU engine the whole one: a first moment
    # whose gradient nearly cancels (an embedding entry of 2e-6) moves by up to ~2e-8
    for k in ("m/blocks.1.moe.experts.w_up", "v/blocks.0.moe.router", "m/embed.weight"):
        np.testing.assert_allclose(got_opt[k], ref_opt[k], rtol=1e-3, atol=5e-8, err_msg=k)


def test_each_rank_holds_its_expert_shard_split_over_data_and_a_quarter_of_the_rest(runs):
    summary = json.loads((runs / "full4" / "mesh.json").read_text())
    assert (summary["world_size"], summary["dp"], summary["ep"], summary["backend"]) == (4, 2, 2, "gloo")
    assert [(r["data"], r["expert"], r["experts"]) for r in summary["ranks"]] == [
        (0, 0, [0, 4]), (0, 1, [4, 8]), (1, 0, [0, 4]), (1, 1, [4, 8])]
    n_params = sum(a.size for a in load_checkpoint(latest_checkpoint(runs / "single"))[0].values()
                   if a.ndim > 1 or a.size != SPEC.model.n_routed_experts)
    held = sum(r["params_bytes"] for r in summary["ranks"])
    assert held == 4 * n_params  # fp32, every parameter on exactly one rank
    assert max(r["params_bytes"] for r in summary["ranks"]) < 0.4 * 4 * n_params


def test_a_resumed_mesh_run_ends_in_the_uninterrupted_runs_state_to_the_bit(runs):
    full, _, _ = read_full(latest_sharded(runs / "full4"))
    resumed, _, _ = read_full(latest_sharded(runs / "half4"))
    for k in full:
        assert np.array_equal(full[k], resumed[k]), k
    key = ("step", "loss", "grad_norm", "drop_frac_send", "drop_frac_recv", "eval_loss")
    assert ([[r[k] for k in key] for r in read_metrics(runs / "half4")]
            == [[r[k] for k in key] for r in read_metrics(runs / "full4")])
    assert read_status(runs / "half4")["state"] == "finished"


def test_two_ranks_continue_four_ranks_export_to_the_single_process_result(runs):
    single, cont = read_metrics(runs / "single"), read_metrics(runs / "from_export2")
    assert [r["step"] for r in cont] == list(range(6))
    np.testing.assert_allclose([r["loss"] for r in cont], [r["loss"] for r in single], rtol=2e-5)
    assert [r["drop_frac_recv"] for r in cont] == [r["drop_frac_recv"] for r in single]
    assert json.loads((runs / "from_export2" / "mesh.json").read_text())["world_size"] == 2
    ref, _, _ = load_checkpoint(latest_checkpoint(runs / "single"))
    got, _, _ = read_full(latest_sharded(runs / "from_export2"))
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=5e-5, err_msg=k)


def test_a_process_count_that_is_no_mesh_is_one_clear_line(runs, tmp_path):
    env = dict(cpu_env(), WORLD_SIZE="3", RANK="0", LOCAL_RANK="0")
    proc = subprocess.run([PY, "-m", "engines.torch.parallel.train", *_args(runs, "x")[:1], "--run-dir",
                           str(tmp_path / "run"), "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: 3 process(es) do not form a (data x expert) mesh")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_each_ranks_parameter_and_optimizer_bytes_are_what_ladder_plan_counts_for_the_mesh(runs):
    from core.costs import memory_per_gpu

    mem = memory_per_gpu(SPEC, mesh=(2, 2))
    for r in json.loads((runs / "full4" / "mesh.json").read_text())["ranks"]:
        # fp32 shards; the plan leaves the norms out (0.4% here) and FSDP2 splits unevenly by a row
        assert r["params_bytes"] == pytest.approx(4 * mem["params_held"], rel=0.05), r
        assert r["optimizer_bytes"] == pytest.approx(mem["optimizer_fp32"], rel=0.05), r


def test_dropless_dp2_ep2_gives_the_single_process_losses_and_drops_nothing(runs):
    single, mesh = read_metrics(runs / "dropless-single"), read_metrics(runs / "dropless4")
    assert [r["step"] for r in mesh] == list(range(6))
    for key in ("loss", "grad_norm", "aux_loss"):
        np.testing.assert_allclose([r[key] for r in mesh], [r[key] for r in single], rtol=2e-5, err_msg=key)
    assert all(r["drop_frac_send"] == 0 and r["drop_frac_recv"] == 0 for r in mesh)
    # the capacity run's drops move its loss far beyond that tolerance: the two are not the same run
    capacity = read_metrics(runs / "single")
    assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(capacity, single)) > 50 * 2e-5


def test_dp2_ep1_gives_the_single_process_losses_without_an_exchange(runs):
    single, mesh = read_metrics(runs / "dataparallel-single"), read_metrics(runs / "dataparallel2")
    assert [r["step"] for r in mesh] == list(range(6))
    for key in ("loss", "grad_norm", "aux_loss"):
        np.testing.assert_allclose([r[key] for r in mesh], [r[key] for r in single], rtol=2e-5, err_msg=key)
    summary = json.loads((runs / "dataparallel2" / "mesh.json").read_text())
    assert (summary["dp"], summary["ep"]) == (2, 1)
    assert all(r["all_to_all_calls"] == 0 for r in summary["ranks"])  # every expert on every rank


def test_each_rank_reads_part_d_of_source_shard_e_and_the_parts_tile_the_batch():
    B, dp, ep = 24, 3, 2
    seen = []
    for rank in range(dp * ep):
        mc = Layout(dp=dp, ep=ep, rank=rank)
        d, e = divmod(rank, ep)
        rows = mc.rows(B)
        assert rows.start == e * (B // ep) + d * (B // (dp * ep))  # part d of source shard e
        assert (rows.start, rows.stop) == (mc.part * B // mc.world, (mc.part + 1) * B // mc.world)
        seen.extend(range(rows.start, rows.stop))
    assert sorted(seen) == list(range(B))
