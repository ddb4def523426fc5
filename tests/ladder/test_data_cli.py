"""`ladder data ...`, the epochs in `ladder plan`, and the data refusals of `validate` and `submit`."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.spec import save_spec
from ladder.presets import micro_spec
from tests import cli_fork
from tests.tokfix import build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def ladder(*args, env=None, cwd=REPO):
    return cli_fork.ladder(*args, cwd=cwd, env={**os.environ, **(env or {})}, timeout=300)


def one_line_error(res, *needles):
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) <= 2 and lines[0].startswith("error:") and "Traceback" not in res.stderr, res.stderr
    text = " ".join(ln.strip() for ln in lines)  # a long line may wrap at the terminal width
    for n in needles:
        assert n in text, (n, text)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_the_h200_plan_shows_a_tokenizer_and_at_most_one_epoch_for_every_run(tmp_path):
    res = ladder("plan", "experiments/proxy_h200.py", "--json", env={"MOE_LADDER_CORPUS": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["rungs"]
    assert {r["role"] for r in rows} == {"rung", "hero"}
    for r in rows:
        d = r["data"]
        assert d["tokenizer"].startswith("h200-16k") and "bytes" not in d["tokenizer"]
        assert all(b.startswith("manifest") for b in d["basis"].values()), d["basis"]
        assert all(0 < e <= 1.0 for e in d["epochs"].values()), (r["name"], d["epochs"])


def test_marin_validates_and_plans_with_llama3_from_a_local_file(tmp_path, tok_path):
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "tokenizer.json").write_bytes(tok_path.read_bytes())
    env = {"MOE_LADDER_TOKENIZERS": str(tmp_path)}
    res = ladder("plan", "experiments/marin_535b.py", "--json", env=env)
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["rungs"]
    assert len(rows) == 5 and all(r["data"]["tokenizer"] == "llama3 (512 ids)" for r in rows)
    from ladder.experiment import load_experiment

    hero = load_experiment(REPO / "experiments" / "marin_535b.py").hero
    res = ladder("validate", save_spec(hero, tmp_path / "hero.yaml"), env=env)
    assert res.returncode == 0 and "d6144: ok" in res.stdout, res.stderr


def test_a_model_vocabulary_below_the_tokenizers_is_refused_at_validation(tmp_path, tok_path):
    spec = save_spec(micro_spec(**{"data.tokenizer": str(tok_path)}), tmp_path / "s.yaml")
    one_line_error(ladder("validate", spec), "model.vocab_size 256 is smaller than tokenizer", "512 ids")


def test_a_missing_tokenizer_file_is_one_line_naming_it(tmp_path):
    spec = save_spec(micro_spec(**{"data.tokenizer": str(tmp_path / "nope.json")}), tmp_path / "s.yaml")
    one_line_error(ladder("data", "prepare", spec), f"{tmp_path / 'nope.json'} does not exist")


def test_prepare_tokenizes_once_then_reuses_and_rejects_a_truncated_shard(tmp_path, tok_path):
    text = tmp_path / "t.txt"
    text.write_text(Path(__file__).read_text() * 5)
    cache = tmp_path / "cache"
    spec = micro_spec(**{"data.tokenizer": str(tok_path), "model.vocab_size": 512,
                         "data.sources": [{"name": "t", "weight": 1.0, "paths": [str(text)]}]})
    path = save_spec(spec, tmp_path / "s.yaml")
    env = {"MOE_LADDER_CACHE": str(cache)}
    first = ladder("data", "prepare", path, "--workers", "1", env=env)
    assert first.returncode == 0 and "t: " in first.stdout and "MB/s" in first.stdout, first.stderr + first.stdout
    again = ladder("data", "prepare", path, env=env)
    assert again.returncode == 0 and "already prepared" in again.stdout
    (part,) = cache.glob("shards/*/part-00000.bin")
    part.write_bytes(part.read_bytes()[:-2])
    one_line_error(ladder("data", "prepare", path, env=env), "data source 't'", str(part), "truncated")
    fixed = ladder("data", "prepare", path, "--rebuild", env=env)
    assert fixed.returncode == 0, fixed.stderr


def test_an_empty_source_is_one_line_and_leaves_no_shards(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    spec = micro_spec(**{"data.sources": [{"name": "blank", "weight": 1.0, "paths": [str(tmp_path / "empty.txt")]}]})
    cache = tmp_path / "cache"
    res = ladder("data", "prepare", save_spec(spec, tmp_path / "s.yaml"), env={"MOE_LADDER_CACHE": str(cache)})
    one_line_error(res, "'blank' is empty")
    assert not list(cache.glob("shards/*"))


def test_submit_refuses_a_run_that_repeats_its_data(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("a small source of text, read many times over " * 200)
    exp = tmp_path / "rep.py"
    exp.write_text(textwrap.dedent(f"""
        from ladder.experiment import Experiment
        from ladder.presets import micro_spec
        src = [{{"name": "small", "weight": 1.0, "paths": [{str(text)!r}]}}]
        EXPERIMENT = Experiment(name="rep", rungs=(micro_spec("r1", **{{"data.sources": src}}),))
    """))
    res = ladder("submit", exp, "--dry-run", "--no-tracking", "--root", tmp_path / "root")
    one_line_error(res, "r1: reads small", "epochs, more than data.max_epochs 1")


def test_ladder_data_tokenizer_trains_a_byte_level_bpe(tmp_path):
    out = tmp_path / "tok.json"
    corpus = Path(__file__).with_name("test_data_cli.py")
    res = ladder("data", "tokenizer", "--corpus", corpus, "--vocab-size", "300", "--out", out)
    assert res.returncode == 0, res.stderr
    from engines.tokenizer import load_tokenizer

    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 300 and tok.decode(tok.encode_docs([b"def ladder(*args)"])[0]) == "def ladder(*args)"


def _stdlib_text(path: Path, size: int) -> Path:
    """Real text: the standard library's Python source, concatenated into one file of `size` bytes."""
    import glob
    import sysconfig

    out = bytearray()
    for f in sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"), recursive=True)):
        out += Path(f).read_bytes()
        if len(out) >= size:
            break
    path.write_bytes(bytes(out[:size]))
    return path


@pytest.mark.slow
def test_prepare_streams_one_large_file_in_bounded_memory(tmp_path, tok_path):
    """One 8 MB text file is one document; tokenized whole, the BPE held ~1.8 GB (about 220 times
    the file). Streamed in pieces the peak stays well under that."""
    text = _stdlib_text(tmp_path / "big.txt", 8_000_000)
    spec = micro_spec(**{"data.tokenizer": str(tok_path), "model.vocab_size": 512,
                         "data.sources": [{"name": "big", "weight": 1.0, "paths": [str(text)]}]})
    path = save_spec(spec, tmp_path / "s.yaml")
    probe = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "ladder.cli", "data", "prepare", str(path),
                          "--workers", "1"], capture_output=True, text=True, cwd=REPO, timeout=900,
                         env={**os.environ, "MOE_LADDER_CACHE": str(tmp_path / "cache")})
    code, peak_kb = map(int, res.stdout.split()[-2:])
    assert code == 0, res.stderr[-3000:]
    assert peak_kb < 900 * 1024, f"peak RSS {peak_kb // 1024} MB"


@pytest.mark.slow
def test_a_document_tokenized_in_pieces_gives_its_whole_document_ids(tmp_path, monkeypatch):
    """Pieces cut after a newline between two non-space characters give the ids of the whole
    document, for the project's byte-level BPEs and bytes."""
    import numpy as np

    from core.spec import SourceSpec
    from engines.shards import prepare
    from engines.tokenizer import load_tokenizer

    text = _stdlib_text(tmp_path / "doc.txt", 2_500_000)  # three pieces
    source = SourceSpec(name="doc", weight=1.0, paths=[str(text)])
    monkeypatch.setenv("MOE_LADDER_CACHE", str(tmp_path / "cache"))
    for name in ("bytes", "experiments/tokenizers/cpu-4k.json"):
        tok = load_tokenizer(str(REPO / name) if name.endswith(".json") else name)
        assert tok.cuts_at_line_starts
        shards = prepare(source, tok, workers=1)
        whole = tok.encode_docs([text.read_bytes()])[0]
        assert shards.n_docs == 1
        assert np.array_equal(np.asarray(shards.parts[0]), np.concatenate([whole, [tok.eos_id]]).astype(tok.dtype))


@pytest.mark.slow
def test_a_sigkilled_prepare_leaves_no_pool_worker_or_resource_tracker(tmp_path, tok_path):
    import signal
    import time

    from ladder.localray import descendants, proc_start

    files = [_stdlib_text(tmp_path / f"f{i}.txt", 600_000 + i) for i in range(8)]
    spec = micro_spec(**{"data.tokenizer": str(tok_path), "model.vocab_size": 512,
                         "data.sources": [{"name": "many", "weight": 1.0, "paths": [str(f) for f in files]}]})
    path = save_spec(spec, tmp_path / "s.yaml")
    cache = tmp_path / "cache"
    drv = subprocess.Popen([sys.executable, "-m", "ladder.cli", "data", "prepare", str(path), "--workers", "2"], cwd=REPO,
                           env={**os.environ, "MOE_LADDER_CACHE": str(cache), "MOE_LADDER_LIMITS": "shard_chunk_bytes=500000"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, procs = time.monotonic() + 300, []  # only to catch a hang
    while time.monotonic() < deadline and drv.poll() is None and not list(cache.glob("shards/*/part-*.json")):
        procs = descendants(drv.pid) or procs
        time.sleep(0.05)
    assert drv.poll() is None, "prepare ended before a part was written"
    procs = descendants(drv.pid)
    assert len(procs) >= 3, procs  # two pool workers and the resource tracker
    drv.kill()
    drv.wait()
    deadline = time.monotonic() + 300  # a hang guard
    while time.monotonic() < deadline and any(proc_start(pid) == start for pid, start in procs):
        time.sleep(0.2)
    alive = [pid for pid, start in procs if proc_start(pid) == start]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "left running after the driver's SIGKILL"
    parts = len(list(cache.glob("shards/*/part-*.json")))
    time.sleep(2)
    assert len(list(cache.glob("shards/*/part-*.json"))) == parts < 8  # nothing kept growing


def test_data_verify_finds_a_changed_shard_whose_mtime_was_kept(tmp_path, tok_path):
    text = tmp_path / "t.txt"
    text.write_text(Path(__file__).read_text() * 3)
    spec = micro_spec(**{"data.tokenizer": str(tok_path), "model.vocab_size": 512,
                         "data.sources": [{"name": "t", "weight": 1.0, "paths": [str(text)]}]})
    path = save_spec(spec, tmp_path / "s.yaml")
    env = {"MOE_LADDER_CACHE": str(tmp_path / "cache")}
    one_line_error(ladder("data", "verify", path, env=env), "data source 't'", "is not prepared")
    assert ladder("data", "prepare", path, "--workers", "1", env=env).returncode == 0
    ok = ladder("data", "verify", path, env=env)
    assert ok.returncode == 0 and "match their sha256" in ok.stdout, ok.stderr
    (part,) = (tmp_path / "cache").glob("shards/*/part-00000.bin")
    st = part.stat()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))  # the cheap check on open cannot see it
    one_line_error(ladder("data", "verify", path, env=env), str(part), "no longer matches its fingerprint")
