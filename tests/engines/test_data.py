import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from engines.data import DataError, TokenStream, load_source
from engines.shards import prepare
from ladder.presets import micro_spec
from core.spec import SourceSpec


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def test_batches_are_int32_windows_of_seq_len_plus_one():
    spec = micro_spec()
    x = TokenStream.from_spec(spec).batch(0)
    assert x.shape == (spec.data.batch_size, spec.data.seq_len + 1)
    assert x.dtype == np.int32 and x.min() >= 0 and x.max() < 256


def test_batches_are_identical_in_another_process():
    spec = micro_spec()
    stream = TokenStream.from_spec(spec)
    here = _digest([stream.batch(s) for s in (0, 7, 99)] + [stream.eval_batch(*stream.eval_plan()[0])])
    code = (
        "import hashlib, numpy as np\n"
        "from engines.data import TokenStream\nfrom ladder.presets import micro_spec\n"
        "st = TokenStream.from_spec(micro_spec())\n"
        "h = hashlib.sha256()\n"
        "for a in [st.batch(s) for s in (0, 7, 99)] + [st.eval_batch(*st.eval_plan()[0])]: h.update(np.ascontiguousarray(a).tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_batch_depends_only_on_seed_step_and_mixture():
    a = TokenStream.from_spec(micro_spec())
    # model / optimizer changes do not touch the stream; order of requests does not matter
    b = TokenStream.from_spec(micro_spec(**{"optim.peak_lr": 1e-2, "model.n_layers": 3}))
    assert np.array_equal(a.batch(41), b.batch(41))
    [b.batch(s) for s in range(5)]
    assert np.array_equal(a.batch(3), b.batch(3))
    other_seed = TokenStream.from_spec(micro_spec(seed=1))
    assert not np.array_equal(a.batch(3), other_seed.batch(3))
    assert not np.array_equal(a.batch(3), a.batch(4))


def test_a_phase_changes_the_mix_only_from_its_start():
    base = micro_spec()
    phased = base.replace(**{"data.phases": [{"name": "docs_only", "start_frac": 0.5, "weights": {"docs": 1.0}}]})
    a, b = TokenStream.from_spec(base), TokenStream.from_spec(phased)
    start = int(0.5 * base.total_steps)
    assert b.mixture_at(start - 1) == a.mixture_at(start - 1)
    assert b.mixture_at(start) == {"code": 0.0, "docs": 1.0}
    assert all(np.array_equal(a.batch(s), b.batch(s)) for s in range(start))
    assert not any(np.array_equal(a.batch(s), b.batch(s)) for s in range(start, start + 5))


def test_missing_source_is_an_error_naming_it(tmp_path):
    spec = micro_spec(**{"data.sources": [{"name": "mybooks", "weight": 1.0, "paths": [str(tmp_path / "no*.txt")]}]})
    with pytest.raises(DataError, match="mybooks"):
        TokenStream.from_spec(spec)


def test_empty_source_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    src = SourceSpec(name="blank", weight=1.0, paths=(str(tmp_path / "empty.txt"),))
    with pytest.raises(DataError, match="'blank' is empty"):
        load_source(src)


def test_jsonl_without_text_key_is_an_error_naming_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "hello"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2 has no 'text' field"):
        load_source(SourceSpec(name="j", weight=1.0, paths=(str(p),)))


def _numbered_docs(tmp_path, n_docs=400, size=120):
    """A jsonl source of n_docs documents, document i made of its own 3-letter word only."""
    p = tmp_path / "numbered.jsonl"
    words = [chr(97 + i // 676) + chr(97 + i // 26 % 26) + chr(97 + i % 26) for i in range(n_docs)]
    p.write_text("".join(json.dumps({"text": (w + " ") * (size // 4)}) + "\n" for w in words))
    return {"name": "num", "weight": 1.0, "paths": [str(p)]}


def test_training_never_reads_a_held_out_document(tmp_path):
    spec = micro_spec(**{"data.sources": [_numbered_docs(tmp_path)], "data.eval_fraction": 0.2})
    st = TokenStream.from_spec(spec)
    es, window = st.sources["num"].evalset, spec.data.seq_len + 1
    held = es.held_H2
    for step in range(min(spec.total_steps, 300)):
        _, starts = st.window_starts(step)
        for s0 in starts:
            assert not ((held[:, 0] < s0 + window) & (held[:, 1] > s0)).any(), (step, s0)
    inside = (es.starts_W[:, None] >= held[None, :, 0]) & (es.starts_W[:, None] + es.window <= held[None, :, 1])
    assert inside.any(axis=1).all()  # every eval window lies in held-out documents


def test_held_out_documents_are_whole_and_absent_from_training_text(tmp_path):
    spec = micro_spec(**{"data.sources": [_numbered_docs(tmp_path)], "data.eval_fraction": 0.2})
    st = TokenStream.from_spec(spec)
    tokens = st.sources["num"].tokens
    held_words = {bytes(tokens[a:a + 3]) for a, _ in st.sources["num"].evalset.held_H2}
    train = np.concatenate([st.batch(s) for s in range(min(spec.total_steps, 300))]).astype(np.uint8)
    text = b"|".join(row.tobytes() for row in train)
    assert held_words and not any(w in text for w in held_words)


def test_eval_set_is_spread_over_the_whole_source(tmp_path):
    spec = micro_spec(**{"data.sources": [_numbered_docs(tmp_path, n_docs=2000)], "data.eval_fraction": 0.2})
    st = TokenStream.from_spec(spec)
    n, starts = st.sources["num"].n_tokens, st.sources["num"].evalset.starts_W
    quarters = np.bincount(starts * 4 // n, minlength=4)
    assert (quarters >= len(starts) // 8).all(), quarters


def test_two_seeds_and_batch_sizes_score_byte_identical_eval_tokens():
    runs = [micro_spec(), micro_spec(seed=1), micro_spec(**{"data.batch_size": 2}),
            micro_spec(**{"data.batch_size": 16, "data.total_tokens": 16 * 64 * 40})]
    streams = [TokenStream.from_spec(s) for s in runs]
    digests = {_digest([st.eval_batch(*b) for b in st.eval_plan()]) for st in streams}
    assert len(digests) == 1
    assert len({st.eval_fingerprint for st in streams}) == 1
    assert len({_digest([st.batch(3)]) for st in streams[:2]}) == 2  # the training streams do differ


def test_another_eval_size_changes_the_eval_fingerprint():
    a = TokenStream.from_spec(micro_spec())
    b = TokenStream.from_spec(micro_spec(**{"data.eval_tokens": 8 * 65 * 2}))
    assert a.eval_fingerprint != b.eval_fingerprint


def test_eval_set_is_stored_beside_the_shards_and_read_back():
    st = TokenStream.from_spec(micro_spec())
    src = next(iter(st.sources.values()))
    stored = list(src.shards.dir.glob("eval-*.npz"))
    assert stored
    again = TokenStream.from_spec(micro_spec())
    assert np.array_equal(next(iter(again.sources.values())).evalset.starts_W, src.evalset.starts_W)


def test_txt_jsonl_and_parquet_sources_read_the_same_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document number {i} says hello\n" * 20 for i in range(5)]
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.txt").write_text(docs[1])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[:2]))
    pq.write_table(pa.table({"body": docs[:2]}), tmp_path / "d.parquet")
    srcs = {
        "txt": SourceSpec(name="txt", weight=1, paths=(str(tmp_path / "*.txt"),)),
        "jsonl": SourceSpec(name="jsonl", weight=1, paths=(str(tmp_path / "d.jsonl"),), text_key="body"),
        "parquet": SourceSpec(name="parquet", weight=1, paths=(str(tmp_path / "d.parquet"),), text_key="body"),
    }
    toks = {k: prepare(s, "bytes").to_array() for k, s in srcs.items()}
    expect = np.frombuffer(b"\0".join(d.encode() for d in docs[:2]) + b"\0", np.uint8)
    for k, t in toks.items():
        assert np.array_equal(t, expect), k


def test_cache_is_rebuilt_when_a_file_changes(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("first version of the text " * 10)
    src = SourceSpec(name="t", weight=1, paths=(str(p),))
    first = prepare(src, "bytes")
    assert prepare(src, "bytes").digest == first.digest
    p.write_text("second version, longer text " * 12)
    assert prepare(src, "bytes").digest != first.digest


def test_builtin_domains_are_real_code_and_real_prose():
    st = TokenStream.from_spec(micro_spec())
    code = bytes(np.asarray(st.sources["code"].tokens[:200_000]))
    docs = bytes(np.asarray(st.sources["docs"].tokens))
    assert code.count(b"def ") > 100 and code.count(b"import ") > 50
    assert b"Python Software Foundation" in docs and docs.count(b" the ") > 1000
    assert len(st.sources["code"].tokens) > 4 * 2**20


# ---- windows without replacement ------------------------------------------------------------


def _words_source(tmp_path, n_bytes: int, name: str = "w"):
    rng = np.random.default_rng(1)
    p = tmp_path / f"{name}.txt"
    p.write_bytes(rng.integers(97, 123, n_bytes, dtype=np.uint8).tobytes())
    return {"name": name, "weight": 1.0, "paths": [str(p)]}


def test_no_training_window_repeats_before_every_window_of_its_source_was_read(tmp_path):
    spec = micro_spec(**{"data.sources": [_words_source(tmp_path, 65 * 8 * 30)], "data.eval_fraction": 0.02})
    st = TokenStream.from_spec(spec)
    n_blocks = int(st.n_blocks[0])
    steps = n_blocks // spec.data.batch_size
    starts = np.concatenate([st.window_starts(s)[1] for s in range(steps)])
    assert len(np.unique(starts)) == len(starts) == steps * spec.data.batch_size  # one epoch: all distinct
    assert set(starts) <= set(st.sources["w"].blocks * st.block)  # the training blocks, block-aligned
    two = np.concatenate([st.window_starts(s)[1] for s in range(2 * n_blocks // spec.data.batch_size)])
    _, seen = np.unique(two, return_counts=True)  # two epochs: every window once, then once more
    assert len(seen) == n_blocks and seen.max() == 2


def test_each_steps_rows_per_source_follow_the_cumulative_mixture(tmp_path):
    srcs = [_words_source(tmp_path, 40_000, "a") | {"weight": 0.7}, _words_source(tmp_path, 40_000, "b") | {"weight": 0.3}]
    st = TokenStream.from_spec(micro_spec(**{"data.sources": srcs}))
    counts = np.zeros(2, np.int64)
    for s in range(50):
        src, _ = st.window_starts(s)
        counts += np.bincount(src, minlength=2)
        assert np.all(np.abs(counts - np.array([0.7, 0.3]) * 8 * (s + 1)) < 1.0 + 1e-9)


def test_a_rank_reads_its_share_of_the_batch_and_the_shares_make_the_batch():
    st = TokenStream.from_spec(micro_spec())
    whole = st.batch(7)
    parts = [st.batch(7, rank=r, world=3) for r in range(3)]
    assert [len(p) for p in parts] == [2, 3, 3]
    assert np.array_equal(np.concatenate(parts), whole)


def test_an_opened_context_stage_reads_blocks_no_earlier_step_read(tmp_path):
    spec = micro_spec(**{"data.sources": [_words_source(tmp_path, 200_000)],
                         "data.context_stages": [{"start_frac": 0.5, "seq_len": 128, "gated": False}]})
    st = TokenStream.from_spec(spec)
    half = spec.total_steps // 2
    before = {int(s) // st.block for k in range(half) for s in st.window_starts(k)[1]}
    after = {int(s) // st.block for k in range(half, spec.total_steps) for s in st.window_starts(k)[1]}
    assert st.seq_len_at(half) == 128 and st.batch(half).shape == (4, 129)
    assert before and after and not before & after


def test_the_block_permutation_is_a_bijection_for_any_size():
    from engines.data import permute

    for n in (1, 2, 3, 17, 1000, 4097):
        p = permute(np.arange(n), n, key=12345)
        assert sorted(p.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))


def test_plan_time_epochs_equal_the_streams_own(tmp_path):
    from engines.data import schedule_epochs

    spec = micro_spec(**{"data.sources": [_words_source(tmp_path, 30_000)]})
    st = TokenStream.from_spec(spec)
    assert st.epochs() == schedule_epochs(spec.data, spec.total_steps, {"w": st.sources["w"].split})
    n_blocks = int(st.n_blocks[0])
    assert st.epochs()["w"] == pytest.approx(spec.total_steps * spec.data.batch_size / n_blocks)


def test_a_bpe_stream_is_deterministic_below_its_vocabulary_and_fingerprints_its_tokenizer(tmp_path):
    from tests.tokfix import build_tokenizer

    tok = str(build_tokenizer(tmp_path / "tok.json"))
    text = [{"name": "t", "weight": 1.0, "paths": [str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")]}]
    spec = micro_spec(**{"data.tokenizer": tok, "model.vocab_size": 512, "data.sources": text})
    st = TokenStream.from_spec(spec)
    x = st.batch(3)
    assert x.max() < 512 and np.array_equal(x, TokenStream.from_spec(spec).batch(3))
    assert st.fingerprint != TokenStream.from_spec(micro_spec(**{"data.sources": text})).fingerprint


def test_a_tokenizer_larger_than_the_model_vocabulary_is_a_data_error(tmp_path):
    from tests.tokfix import build_tokenizer

    tok = str(build_tokenizer(tmp_path / "tok.json"))
    with pytest.raises(DataError, match="more than model.vocab_size 256"):
        TokenStream.from_spec(micro_spec(**{"data.tokenizer": tok}))
