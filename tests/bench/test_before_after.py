"""bench/before_after.py: the engines bench from two source trees, alternately, in subprocesses.
End to end on the CPU (--cpu-smoke: the before commit's bench, which has no --cpu-smoke, runs
--tiny with the GPU hidden), and each tree's command line built from the flags its bench has."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.before_after import DEFAULT_REF, bench_variants, leg_command, summarise

ROOT = Path(__file__).resolve().parents[2]


def _has_commit(ref: str) -> bool:
    try:
        return subprocess.run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], cwd=ROOT,
                              capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
def test_before_after_runs_both_trees_and_reports_the_ratio(tmp_path):
    """One pair, before (the redesign's parent commit, HEAD where the history lacks it) then
    after: both legs' rows and their ratio land in the table and the json."""
    if not _has_commit("HEAD"):
        pytest.skip("no git history in this copy")
    ref = DEFAULT_REF if _has_commit(DEFAULT_REF) else "HEAD"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench/before_after.py"), "--cpu-smoke", "--only", "torch",
                           "--steps", "1", "--warmup", "1", "--repeat", "1", "--ref", ref, "--out", str(tmp_path),
                           "--legs-dir", str(tmp_path / "legs")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((tmp_path / "before_after.json").read_text())
    assert got["order"] == ["before", "after"]
    assert got["before"]["commit"].startswith(subprocess.run(["git", "rev-parse", ref], cwd=ROOT, text=True,
                                                             capture_output=True).stdout.strip()[:7])
    before, after = got["legs"]
    assert before["cwd"] != after["cwd"] and Path(after["cwd"]) == ROOT
    assert ("--tiny" if ref == DEFAULT_REF else "--cpu-smoke") in before["cmd"] and "--cpu-smoke" in after["cmd"]
    (cell,) = got["table"]
    assert cell["variant"] == "torch" and len(cell["before_tps"]) == len(cell["after_tps"]) == 1
    assert cell["ratio"] == pytest.approx(cell["after_tps"][0] / cell["before_tps"][0])
    assert cell["pair_ratios"] == [pytest.approx(cell["ratio"])]
    md = (tmp_path / "before_after.md").read_text()
    assert "| torch | E16 seq 128 |" in md and f"{cell['ratio']:.3f}x" in md


def _tree(path: Path, flags: list[str], variants: list[str]) -> Path:
    bench = path / "bench/engines_h200.py"
    bench.parent.mkdir(parents=True)
    bench.write_text("\n".join([f'    ap.add_argument("{f}", default=None)' for f in flags]
                               + [f'        "{v}": (run_torch, {{}}),' for v in variants]))
    return path


class Args:
    python, only, steps, warmup, shape, d768, cpu_smoke = "py", "torch", 2, 1, "olmoe", "", True


def test_each_tree_gets_the_flags_its_bench_has(tmp_path, monkeypatch):
    """--cpu-smoke becomes --tiny with the GPU hidden for a bench without it; --budget-s goes
    only where it exists; a flag a tree lacks is refused before any leg runs; MOE_LADDER_* stay out."""
    monkeypatch.setenv("MOE_LADDER_OPTIONS", "torch_master=0")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    common = ["--only", "--steps", "--warmup", "--out", "--tiny", "--shape"]
    old = _tree(tmp_path / "old", common, ["torch", "torch_cap"])
    new = _tree(tmp_path / "new", common + ["--cpu-smoke", "--budget-s", "--d768"], ["torch", "torch_mesh"])
    cmd, env = leg_command(old, Args, tmp_path / "o", 100.0)
    assert cmd[-1] == "--tiny" and "--budget-s" not in cmd
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["JAX_PLATFORMS"] == "cpu" and env["PYTHONPATH"] == str(old)
    assert "MOE_LADDER_OPTIONS" not in env
    cmd, _ = leg_command(new, Args, tmp_path / "o", 100.0)
    assert cmd[-1] == "--cpu-smoke" and cmd[cmd.index("--budget-s") + 1] == "100"
    assert bench_variants(new) == {"torch", "torch_mesh"}

    class D768(Args):
        d768 = "torch"

    assert "--d768" in leg_command(new, D768, tmp_path / "o", 1.0)[0]
    with pytest.raises(SystemExit, match="--d768"):
        leg_command(old, D768, tmp_path / "o", 1.0)


def test_a_leg_imports_its_own_tree_first_and_keeps_the_callers_other_paths(tmp_path, monkeypatch):
    """Packages the caller put on PYTHONPATH (installed with --target on a bare GPU machine) stay
    on the leg's path, after the leg's tree; the repository itself and "." do not."""
    common = ["--only", "--steps", "--warmup", "--out", "--tiny", "--shape"]
    old = _tree(tmp_path / "old", common, ["torch"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", ".", str(ROOT), "/opt/more"]))
    _, env = leg_command(old, Args, tmp_path / "o", 100.0)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(old), "/tmp/site", "/opt/more"]


def test_the_table_pairs_legs_in_order():
    def leg(name, pair, tps):
        return {"leg": name, "pair": pair, "rows": [{"variant": "torch", "key": ["E64", 4096], "tokens_per_s": tps,
                                                     "timed_losses": [5.0]}]}

    (cell,) = summarise([leg("before", 0, 100.0), leg("after", 0, 120.0), leg("before", 1, 110.0),
                         leg("after", 1, 121.0)])
    assert cell["before_tps"] == [100.0, 110.0] and cell["after_tps"] == [120.0, 121.0]
    assert cell["pair_ratios"] == pytest.approx([1.2, 1.1])
    assert cell["ratio"] == pytest.approx(120.5 / 105.0)
    assert cell["before_spread"] == pytest.approx(10 / 105)
