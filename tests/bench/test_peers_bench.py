"""The peers (OLMo-core, torchtitan) and the d768 rung in bench/engines_h200.py, as far as a CPU
allows: the d768 shape trains in both dispatch modes and profiles, the peers are built on the meta
device at the bench's shape (or say why they cannot be imported), and the "vs faster peer"
column divides by the faster peer of the same shape."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One bench run for the tests below: the peers at the tiny OLMoE shape, then the tiny d768
    rung in both dispatch modes with the dropless step profiled."""
    out = tmp_path_factory.mktemp("peers_bench")
    rows = _bench(out, "--only", "olmo-core,torchtitan", "--d768", "torch,torch_cap", "--profile", "torch")
    return out, rows


def _bench(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench/engines_h200.py"), "--tiny", "--steps", "1",
                           "--warmup", "1", "--out", str(tmp_path), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_d768_rung_trains_in_both_dispatch_modes_and_writes_a_breakdown(bench_run):
    tmp_path, rows = bench_run
    rows = {r["variant"]: r for r in rows if r["key"][0] == "d768"}
    sys.path.insert(0, str(ROOT / "bench"))
    import engines_h200 as eb
    from core.costs import flops_per_token

    spec = eb.make_spec(2, seq=128, batch=2, **eb.d768_model(tiny=True))
    assert spec.model.latent_dim and spec.model.n_shared_experts == 2 and spec.model.n_kv_heads == 1
    for name in ("torch", "torch_cap"):
        r = rows[name]
        assert "error" not in r, r.get("error")
        assert r["key"] == ["d768", 128]
        assert r["flops_per_token"] == pytest.approx(flops_per_token(spec, 128))  # the head counted
    assert rows["torch"]["losses"][1] < rows["torch"]["losses"][0]
    assert "breakdown" in rows["torch"]["info"] and "breakdown" not in rows["torch_cap"]["info"]
    assert "### torch at d768 seq 128" in (tmp_path / "breakdown.md").read_text()


def _have_peers() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("olmo_core", "torchtitan"))


@pytest.mark.slow
def test_peers_are_built_on_the_meta_device_without_a_gpu(bench_run):
    _, rows = bench_run
    rows = {r["variant"]: r for r in rows if r["key"][0] == "E16"}
    for peer in ("olmo-core", "olmo-core_v1", "torchtitan"):
        r = rows[f"{peer}_meta"]
        if not _have_peers():
            assert "not importable" in r["error"] or "No module named" in r["error"]
            continue
        assert "error" not in r, r["error"]
        # the same shape: the parameters differ only by norm weights (well under 1%)
        assert r["meta"]["params"] == pytest.approx(r["ours_params"], rel=0.01)
    assert not any(r["variant"] in ("olmo-core", "torchtitan") for r in rows.values())  # no CPU training


def test_vs_faster_peer_divides_by_the_faster_peer_of_the_same_shape():
    sys.path.insert(0, str(ROOT / "bench"))
    import engines_h200 as eb

    def row(variant, key, tps):
        return {"variant": variant, "key": list(key), "tokens_per_s": tps, "tflops": 1.0, "mfu": 0.1,
                "peak_gib": 1.0, "warmup_s": 1.0, "timed_losses": [2.0, 1.0], "losses": [3.0, 2.0, 1.0],
                "info": {}, "vs_ref": None}

    rows = [row("torchtitan", ("E64", 4096), 100.0), row("olmo-core_v1", ("E64", 4096), 150.0),
            row("torch", ("E64", 4096), 300.0), row("torch", ("d768", 4096), 50.0),
            row("torchtitan", ("d768", 4096), 25.0), {"variant": "olmo-core", "key": ["E64", 4096],
                                                      "error": "RuntimeError: needs Transformer Engine"}]
    assert eb.faster_peer(rows, ("E64", 4096)) == ("olmo-core_v1", 150.0)
    args = type("A", (), {"warmup": 1, "steps": 1})()
    table = eb.format_tables(rows, 1e12, {"gpu": "g", "torch": "t", "transformers": "x"}, args)
    lines = {tuple(c.strip() for c in ln.split("|")[1:3]): ln for ln in table.splitlines() if ln.startswith("| E")
             or ln.startswith("| d")}
    assert "| 2.00x |" in lines[("E64 seq 4096", "torch")]
    assert "| 2.00x |" in lines[("d768 seq 4096", "torch")]
    assert "| 1.00x |" in lines[("E64 seq 4096", "olmo-core_v1")]
    assert "failed: RuntimeError: needs Transformer Engine" in lines[("E64 seq 4096", "olmo-core")]


def test_torchtitan_builder_follows_the_api_generation_of_its_version():
    sys.path.insert(0, str(ROOT / "bench"))
    import peers

    assert [peers.titan_generation(v) for v in ("0.2.0", "0.2.2", "0.3.0", "0.3.1.dev0", "1.0.0")] == \
        ["0.2", "0.2", "0.3", "0.3", "0.3"]
