import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from core.spec import SourceSpec
from engines.data import DataError
from engines.shards import open_shards, prepare, shard_dir
from engines.tokenizer import load_tokenizer
from tests.tokfix import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def _docs_source(tmp_path, n_docs=40, name="d"):
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + len('{'ab' * i}')\n"}) + "\n"
                         for i in range(n_docs)))
    return SourceSpec(name=name, weight=1.0, paths=(str(p),))


def test_shards_are_memmapped_token_parts_with_a_document_index(tmp_path, tok):
    sh = prepare(_docs_source(tmp_path), tok)
    assert sh.index["dtype"] == "uint16" and isinstance(sh.parts[0], np.memmap)
    ends = np.load(sh.dir / "part-00000.docs.npy")
    tokens = sh.to_array()
    assert len(ends) == sh.n_docs == 40 and ends[-1] == sh.n_tokens
    assert (tokens[ends - 1] == tok.eos_id).all() and (np.delete(tokens, ends - 1) != tok.eos_id).all()
    assert tok.decode(tokens[: ends[0] - 1]).startswith("def f0(x):")


def test_shards_are_reused_across_specs_naming_the_same_files(tmp_path, tok):
    src = _docs_source(tmp_path)
    first = prepare(src, tok)
    mtime = (first.dir / "index.json").stat().st_mtime_ns
    again = prepare(src.model_copy(update={"name": "other", "weight": 0.3}), tok)
    assert again.dir == first.dir and (again.dir / "index.json").stat().st_mtime_ns == mtime


def test_a_truncated_shard_is_an_error_naming_the_source_and_file(tmp_path, tok):
    src = _docs_source(tmp_path)
    part = prepare(src, tok).dir / "part-00000.bin"
    with open(part, "r+b") as f:
        f.truncate(part.stat().st_size - 2)
    with pytest.raises(DataError, match=rf"data source 'd': shard {part} is truncated"):
        open_shards(src, tok)


def test_a_shard_whose_content_changed_no_longer_matches_its_fingerprint(tmp_path, tok):
    src = _docs_source(tmp_path)
    part = prepare(src, tok).dir / "part-00000.bin"
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"shard {part} no longer matches its fingerprint"):
        open_shards(src, tok)


def test_token_ids_beyond_the_vocabulary_are_refused_and_nothing_is_written(tmp_path, tok):
    src = _docs_source(tmp_path)
    with pytest.raises(DataError, match=r"docs.jsonl makes token id \d+ >= model.vocab_size 300"):
        prepare(src, tok, vocab_limit=300)
    assert not shard_dir(src, tok).exists()


def test_an_empty_source_is_an_error_and_leaves_nothing_behind(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("")
    src = SourceSpec(name="blank", weight=1.0, paths=(str(tmp_path / "empty.txt"),))
    with pytest.raises(DataError, match="'blank' is empty"):
        prepare(src, tok)
    assert not shard_dir(src, tok).exists()


def test_parallel_workers_write_the_same_shards_as_one(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("MOE_LADDER_LIMITS", "shard_chunk_bytes=200")
    for i in range(12):
        (tmp_path / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (i + 5))
    src = SourceSpec(name="files", weight=1.0, paths=(str(tmp_path / "f*.py"),))
    one = prepare(src, tok, workers=1)
    digest, tokens = one.digest, one.to_array()
    prepare(src, tok, workers=2, rebuild=True)
    two = open_shards(src, tok)
    assert len(two.parts) > 4 and two.digest == digest and np.array_equal(two.to_array(), tokens)


_PREPARE = textwrap.dedent("""
    import sys
    from core.spec import SourceSpec
    from engines.shards import prepare
    src = SourceSpec(name="big", weight=1.0, paths=(sys.argv[1],))
    print(prepare(src, "bytes", workers=1).digest)
""")


@pytest.mark.slow
def test_prepare_resumes_after_sigkill_and_ends_as_an_uninterrupted_run(tmp_path):
    rng = np.random.default_rng(0)
    words = np.array([b"alpha", b"beta", b"gamma", b"delta", b"\n"])
    big = tmp_path / "big.txt"
    for i in range(60):  # 60 files of ~200 KB: one chunk each
        (tmp_path / f"f{i:02d}.txt").write_bytes(b" ".join(rng.choice(words, 40_000)))
    pattern = str(tmp_path / "f*.txt")
    env = {**os.environ, "MOE_LADDER_LIMITS": "shard_chunk_bytes=150000"}
    proc = subprocess.Popen([sys.executable, "-c", _PREPARE, pattern], env=env, stdout=subprocess.PIPE)
    src = SourceSpec(name="big", weight=1.0, paths=(pattern,))
    os.environ["MOE_LADDER_LIMITS"] = "shard_chunk_bytes=150000"
    try:
        out_dir = shard_dir(src, load_tokenizer("bytes"))
        deadline = time.time() + 300  # a hang guard
        while len(list(out_dir.glob("part-*.json"))) < 5 and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        done = len(list(out_dir.glob("part-*.json")))
        assert 5 <= done < 60 and not (out_dir / "index.json").exists()
        kept = (out_dir / "part-00000.bin").stat().st_mtime_ns
        resumed = subprocess.run([sys.executable, "-c", _PREPARE, pattern], env=env, capture_output=True,
                                 text=True, check=True).stdout.strip()
        assert (out_dir / "part-00000.bin").stat().st_mtime_ns == kept  # finished parts are not redone
        whole = prepare(src, "bytes", rebuild=True)
        assert resumed == whole.digest and whole.n_tokens == sum(
            (tmp_path / f"f{i:02d}.txt").stat().st_size + 1 for i in range(60))
    finally:
        os.environ.pop("MOE_LADDER_LIMITS", None)
        proc.kill()
    assert not big.exists()


_RSS = textwrap.dedent("""
    import sys
    from engines.data import TokenStream
    from ladder.presets import micro_spec
    spec = micro_spec(**{"data.sources": [{"name": "big", "weight": 1.0, "paths": [sys.argv[1]]}],
                         "data.total_tokens": 64 * 8 * 400, "data.eval_tokens": 64 * 65})  # a fixed-size eval set
    st = TokenStream.from_spec(spec)
    for s in range(400):
        st.batch(s)
    print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")][0])
""")


@pytest.mark.slow
def test_resident_memory_does_not_grow_with_the_corpus(tmp_path):
    """Anonymous resident memory (file pages of the memmaps are the kernel's cache, not the
    process's) after reading 400 batches: a corpus 16x larger costs no more (the eval set held at
    one size: it is sized in tokens, data.eval_tokens)."""
    rng = np.random.default_rng(0)
    rss = {}
    for mb in (4, 64):
        p = tmp_path / f"c{mb}.txt"
        p.write_bytes(rng.integers(97, 123, mb * 2**20, dtype=np.uint8).tobytes())
        subprocess.run([sys.executable, "-c", "import sys; from core.spec import SourceSpec; from engines.shards "
                        "import prepare; prepare(SourceSpec(name='big', weight=1.0, paths=(sys.argv[1],)), 'bytes')",
                        str(p)], check=True)
        out = subprocess.run([sys.executable, "-c", _RSS, str(p)], capture_output=True, text=True, check=True)
        rss[mb] = int(out.stdout.strip().splitlines()[-1])  # kB
    assert rss[64] - rss[4] < 8 * 1024, rss  # 60 MB more corpus, under 8 MB more memory
