import json

import pytest

from core.spec import SourceSpec
from engines import corpus
from engines.shards import prepare
from tests.tokfix import build_tokenizer


@pytest.fixture
def roots(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "a.py").write_text("def a():\n    return 1\n")
    (site / "pkg" / "copy_of_a.py").write_text("def a():\n    return 1\n")  # the same content twice
    (site / "pkg" / "b.py").write_text("import os\nprint(os.sep)\n" * 20)
    (site / "pkg" / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))  # not UTF-8
    (site / "pkg" / "README.md").write_text("# pkg\n\nA package that says hello.\n")
    (site / "pkg" / "k.cu").write_text("__global__ void k(float *x) { x[threadIdx.x] = 0; }\n")
    monkeypatch.setattr(corpus, "python_roots", lambda: [site])
    monkeypatch.setattr(corpus, "native_roots", lambda: [site])
    return tmp_path


def test_the_corpus_keeps_each_text_once_with_its_path_and_counts_its_tokens_as_training_will(roots, monkeypatch):
    tok = build_tokenizer(roots / "tok.json")
    out = roots / "corpus"
    m = corpus.build(out, [str(tok)], workers=1, log=lambda *_: None)
    py = m["parts"]["python"]
    assert py["files"] == 2 and py["duplicates_dropped"] == 1 and py["skipped"] == 1
    docs = [json.loads(line) for line in (out / "python" / py["shards"][0]).read_text().splitlines()]
    assert {d["path"].rsplit("/", 1)[1] for d in docs} <= {"a.py", "copy_of_a.py", "b.py"} and len(docs) == 2
    assert all({"text", "path", "package", "license"} <= set(d) for d in docs)
    assert m["parts"]["docs"]["files"] == 1 and m["parts"]["native"]["files"] == 1
    monkeypatch.setenv("MOE_LADDER_CORPUS", str(out))
    (counted,) = py["tokens"].values()
    shards = prepare(SourceSpec(name="py", weight=1.0, builtin="packages_python"), str(tok))
    assert counted["tokens"] == shards.n_tokens
