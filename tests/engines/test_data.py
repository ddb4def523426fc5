import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from engines.data import DataError, TokenStream, load_source
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
    here = _digest([stream.batch(s) for s in (0, 7, 99)] + [stream.eval_batch(0)])
    code = (
        "import hashlib, numpy as np\n"
        "from engines.data import TokenStream\nfrom ladder.presets import micro_spec\n"
        "st = TokenStream.from_spec(micro_spec(), use_cache=False)\n"
        "h = hashlib.sha256()\n"
        "for a in [st.batch(s) for s in (0, 7, 99)] + [st.eval_batch(0)]: h.update(np.ascontiguousarray(a).tobytes())\n"
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


def test_held_out_split_is_disjoint_from_training_windows(tmp_path):
    # training part all 'a', held-out tail all 'b': any leak shows up as a wrong byte
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"text": "a" * 9000 + "b" * 1000}) + "\n")
    spec = micro_spec(**{"data.sources": [{"name": "ab", "weight": 1.0, "paths": [str(p)]}],
                         "data.eval_fraction": 0.1})
    st = TokenStream.from_spec(spec)
    assert st.sources["ab"].split == 9000
    train = np.concatenate([st.batch(s) for s in range(200)])
    held = np.concatenate([st.eval_batch(i) for i in range(20)])
    assert set(np.unique(train)) == {ord("a")}
    assert set(np.unique(held)) <= {ord("b"), 0}


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
    toks = {k: np.asarray(load_source(s).tokens) for k, s in srcs.items()}
    expect = np.frombuffer(b"\0".join(d.encode() for d in docs[:2]) + b"\0", np.uint8)
    for k, t in toks.items():
        assert np.array_equal(t, expect), k


def test_cache_is_rebuilt_when_a_file_changes(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("first version of the text " * 10)
    src = SourceSpec(name="t", weight=1, paths=(str(p),))
    first = load_source(src)
    assert load_source(src).digest == first.digest
    p.write_text("second version, longer text " * 12)
    assert load_source(src).digest != first.digest


def test_builtin_domains_are_real_code_and_real_prose():
    st = TokenStream.from_spec(micro_spec())
    code = bytes(np.asarray(st.sources["code"].tokens[:200_000]))
    docs = bytes(np.asarray(st.sources["docs"].tokens))
    assert code.count(b"def ") > 100 and code.count(b"import ") > 50
    assert b"Python Software Foundation" in docs and docs.count(b" the ") > 1000
    assert len(st.sources["code"].tokens) > 4 * 2**20
