"""The H200 bench scripts run end to end in their --tiny mode on the CPU (real subprocesses, real
training steps), so a GPU session never spends device time on a script that cannot start: the
engine variants each write a result row, both engines and both dispatch modes give the same
losses step for step, and the profiler writes its table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ["torch", "torch_castmasters", "torch_inductorgather", "torch_cudagraphs", "torch_compileadam", "torch_torchdw", "torch_fusedswiglu", "torch_fusedgather", "torch_fp32router", "torch_inductorswiglu", "torch_bf16moments", "torch_ropebhsq", "torch_inductorxent", "torch_combinekernel", "torch_combinebf16", "torch_combinegraphs", "torch_nographs", "torch_block1024", "torch_bf16graphs", "jax", "jax_bf16moments", "jax_defaulttiles", "jax_cublas", "torch_cap", "jax_cap"]


def _run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_engine_bench_variants_train_and_agree(tmp_path):
    # JAX variants whose switches only a GPU reads compile the same step: the cache serves them
    _run(str(ROOT / "bench/engines_h200.py"), "--tiny", "--only", ",".join(VARIANTS), "--steps", "1",
         "--warmup", "1", "--jax-cache", str(tmp_path / "jaxcache"), "--out", str(tmp_path), cwd=tmp_path)
    rows = {r["variant"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(VARIANTS)
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["tokens_per_s"] > 0 and len(r["losses"]) == 2  # the warm-up step's and the timed step's
    for name in VARIANTS[1:]:  # one model, one init, one batch stream: the same curve everywhere
        assert rows[name]["losses"] == pytest.approx(rows["torch"]["losses"], rel=2e-3), name
    assert rows["torch"]["losses"][-1] < rows["torch"]["losses"][0]
    assert "| E16 seq 128 | jax |" in (tmp_path / "table.md").read_text()


REPEATED = ("torch", "torch_nographs", "torch_mesh", "torch_mesh_cap", "jax")


@pytest.fixture(scope="module")
def repeated(tmp_path_factory):
    """One bench process for the repeat properties and the mesh rows: torch variants (two through
    the multi-process layout) and a JAX variant, the list run twice (--repeat 2) with JAX's
    compilation cache on (--jax-cache)."""
    out = tmp_path_factory.mktemp("repeat")
    _run(str(ROOT / "bench/engines_h200.py"), "--tiny", "--only", ",".join(REPEATED), "--repeat", "2",
         "--steps", "1", "--warmup", "1", "--jax-cache", str(out / "jaxcache"), "--out", str(out), cwd=out)
    return out, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_repeat_runs_the_variant_list_over_interleaved(repeated):
    _, rows = repeated
    assert [r["variant"] for r in rows] == list(REPEATED) * 2
    assert rows[0]["losses"] == pytest.approx(rows[len(REPEATED)]["losses"], rel=1e-6)  # the same run, repeated


def test_torch_mesh_trains_the_torch_rows_model_through_the_layouts_step(repeated):
    """torch_mesh (and _cap): the torch row's model through the multi-process layout's step module
    (engines/torch/step.TorchStep with FSDP2) as a process group of one, gloo on the CPU, the
    model's one forward, the torch row's curve; the group is torn down after each variant, so the list
    run twice (--repeat 2) meets again on a fresh port."""
    out, rows = repeated
    torch0 = rows[0]
    mesh = [r for r in rows if r["variant"] in ("torch_mesh", "torch_mesh_cap")]
    assert [r["variant"] for r in mesh] == ["torch_mesh", "torch_mesh_cap"] * 2
    for r in mesh:
        assert "error" not in r, (r["variant"], r.get("error"))
        assert r["tokens_per_s"] > 0 and r["losses"] == pytest.approx(torch0["losses"], rel=2e-3)
        assert r["info"]["mesh"] == [1, 1] and r["info"]["backend"] == "gloo" and r["info"]["lookahead"] is False
        assert r["info"]["describe"]["torch_fast"] is False  # the GPU kernels are a CUDA path
    # a group of one holds every expert: dropless needs no exchange (the one-device Dropless)
    assert [r["info"]["describe"]["torch_dispatch"] for r in mesh[:2]] == ["Dropless", "PooledWave"]
    assert "| torch_mesh |" in (out / "table.md").read_text()


def test_a_repeated_jax_variant_loads_its_step_from_the_compilation_cache(repeated):
    """--jax-cache: the second row of one JAX variant finds its compiled step in the cache (the
    first compiles and writes it) and trains the same losses."""
    out, rows = repeated
    jax_rows = [r for r in rows if r["variant"] == "jax"]
    assert len(jax_rows) == 2 and jax_rows[0]["losses"] == jax_rows[1]["losses"]
    assert [r["info"]["step_from_cache"] for r in jax_rows] == [False, True]
    assert len([p for p in (out / "jaxcache").iterdir() if p.name.startswith("jit_step-")]) == 1


def test_tile_tuner_reports_every_expert_matmul(tmp_path):
    """bench/tune_mgpu.py starts and reports all six matmuls (on the CPU every Mosaic-GPU config
    is refused, and each op says so)."""
    done = _run(str(ROOT / "bench/tune_mgpu.py"), "--tiny", "--out", str(tmp_path), cwd=tmp_path)
    got = json.loads((tmp_path / "tune_mgpu.json").read_text())
    assert sorted(got) == sorted(["gu_fwd", "gu_dx", "gu_dw", "dn_fwd", "dn_dx", "dn_dw"])
    assert "every config failed" in done.stdout
    from engines.jax.fast import load_tiles

    assert load_tiles(str(tmp_path / "mgpu_tiles.json")) == {}  # a tile file, empty when nothing ran


def test_tile_tuner_lax_mode_times_current_tiles_and_lax_form(tmp_path):
    """--lax reports, for each forward and input-gradient matmul, the current tiles' entry and the
    lax.ragged_dot form's timing with whether a cuDNN call was compiled (none on the CPU)."""
    _run(str(ROOT / "bench/tune_mgpu.py"), "--tiny", "--lax", "--ops", "gu_fwd,dn_dx", "--out", str(tmp_path),
         cwd=tmp_path)
    got = json.loads((tmp_path / "tune_mgpu.json").read_text())
    for op in ("gu_fwd", "dn_dx"):
        assert got[op]["lax_cudnn"]["ms"] > 0 and got[op]["lax_cudnn"]["cudnn"] is False
        assert got[op]["lax_cudnn"]["rel_err"] == 0.0
        assert "cfg" in got[op]["current"]


def test_gather_bench_forms_agree(tmp_path):
    """bench/jax_gather.py times each row move both ways; the moves of bf16 rows agree bitwise."""
    _run(str(ROOT / "bench/jax_gather.py"), "--tiny", "--out", str(tmp_path), cwd=tmp_path)
    moves = json.loads((tmp_path / "jax_gather.json").read_text())["moves"]
    assert sorted(moves) == ["combine", "combine_bwd", "dispatch", "dispatch_bwd"]
    for name in ("dispatch", "dispatch_bwd", "combine"):
        assert moves[name]["bitwise_equal"], name
    assert moves["combine_bwd"]["max_rel_diff"] < 1e-2  # one more rounding to bf16


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_profiler_writes_its_table(tmp_path, engine):
    _run(str(ROOT / "bench/profile_h200.py"), "--tiny", "--engine", engine, "--warmup", "1", "--steps", "1",
         "--out", str(tmp_path), cwd=tmp_path)
    table = tmp_path / ("profile.md" if engine == "torch" else "profile_jax.md")
    assert "ms/step" in table.read_text()


def test_ep_bench_runs_both_engines_and_matches_one_device(tmp_path):
    """bench/ep_multi_gpu.py with no GPU: torch ranks (gloo) and JAX's mesh over 2 emulated CPU
    devices, each against one device with the 2 shards emulated, appear in the table with the
    same drops and losses within fp32 rounding."""
    _run(str(ROOT / "bench/ep_multi_gpu.py"), "--cpu", "--engine", "torch,jax", "--ep", "2", "--steps", "3",
         "--warmup", "1", "--out", str(tmp_path), cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    got = {(r["engine"], r["kind"]): r for r in rows}
    assert sorted(got) == [("jax", "ep"), ("jax", "single"), ("torch", "ep"), ("torch", "single")]
    for engine in ("torch", "jax"):
        ep, one = got[(engine, "ep")], got[(engine, "single")]
        assert ep["drops"] == one["drops"] and ep["drop_frac_recv"] > 0
        assert ep["losses"] == pytest.approx(one["losses"], rel=1e-5)
    table = (tmp_path / "table.md").read_text()
    assert "| 2 | 2 |" in table and "JAX engine, emulated CPU devices" in table


def test_cpu_smoke_runs_the_command_line_on_the_engines_step_modules(tmp_path):
    """--cpu-smoke: the H200 command line at the tiny shape on the CPU (whatever GPU is there), each
    engine through its own step module, writing the rows and table an H200 run writes; the
    variant that once set an environment switch now sets its option and trains the same curve."""
    _run(str(ROOT / "bench/engines_h200.py"), "--cpu-smoke", "--only", "torch,jax,jax_defaulttiles", "--steps", "1",
         "--warmup", "1", "--out", str(tmp_path), cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["torch", "jax", "jax_defaulttiles"]
    for r in rows:
        assert "error" not in r and r["key"] == ["E16", 128] and r["tokens_per_s"] > 0
        assert set(r) >= {"tflops", "mfu", "peak_gib", "warmup_s", "timed_s", "flops_per_token", "vs_ref", "info"}
    assert rows[0]["info"]["options"]["torch_kernels"]["compile"] == "block-cudagraphs"  # built by the bench
    assert rows[1]["losses"] == pytest.approx(rows[0]["losses"], rel=2e-3)
    assert rows[2]["losses"] == rows[1]["losses"]  # one tile or tuned tiles: the GPU's concern only
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("GPU cpu;") and "| E16 seq 128 | jax_defaulttiles |" in table
