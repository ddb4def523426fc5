import json

import pytest

from engines.tokenizer import TokenizerError, check_vocab, load_tokenizer, padded_vocab, resolve
from ladder.presets import micro_spec
from tests.tokfix import build_tokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_a_trained_bpe_round_trips_text_with_an_end_of_text_id(tok_path):
    tok = load_tokenizer(str(tok_path))
    text = "def parse_args(self, args=None):\n    return self.parse_known_args(args)\n"
    (ids,) = tok.encode_docs([text.encode()])
    assert tok.vocab_size == 512 and tok.eos_id == 0 and tok.dtype.name == "uint16"
    assert tok.decode(ids) == text and len(ids) < len(text) / 2 and ids.max() < 512


def test_a_preset_name_resolves_to_the_users_file(tok_path, tmp_path, monkeypatch):
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "tokenizer.json").write_bytes(tok_path.read_bytes())
    monkeypatch.setenv("MOE_LADDER_TOKENIZERS", str(tmp_path))
    assert resolve("llama3") == (tmp_path / "llama3" / "tokenizer.json").resolve()
    assert load_tokenizer("llama3").digest == load_tokenizer(str(tok_path)).digest


def test_a_missing_preset_names_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LADDER_TOKENIZERS", str(tmp_path))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer("llama3")
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "llama3" / "tokenizer.json") in msg and "huggingface-cli download" in msg


def test_a_corrupt_tokenizer_file_is_an_error_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"type": "BPE"}})[:-3])
    with pytest.raises(TokenizerError, match=f"{bad} is not a valid tokenizer.json"):
        load_tokenizer(str(bad))


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(tok_path):
    spec = micro_spec(**{"data.tokenizer": str(tok_path)})  # vocab_size 256 < 512 ids
    with pytest.raises(TokenizerError, match="model.vocab_size 256 is smaller than tokenizer"):
        check_vocab(spec)
    assert check_vocab(spec.replace(**{"model.vocab_size": padded_vocab(str(tok_path))})) is not None


def test_the_shipped_tokenizers_load_and_pad_to_a_multiple_of_128():
    for name, n in (("cpu-4k", 4096), ("h200-16k", 16384)):
        assert load_tokenizer(name).vocab_size == n and padded_vocab(name) % 128 == 0
