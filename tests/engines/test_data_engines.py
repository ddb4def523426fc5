"""Both engines read a BPE-tokenized source from its shards deterministically and resume exactly:
a run stopped after a checkpoint and resumed ends bit-equal to an uninterrupted one."""

import itertools
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from engines.base import read_metrics
from engines.checkpoint import latest_checkpoint, load_checkpoint
from ladder.presets import micro_spec
from tests.tokfix import build_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    tok = build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    text = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")
    return micro_spec(**{"data.tokenizer": str(tok), "model.vocab_size": 512,
                         "data.sources": [{"name": "argparse", "weight": 1.0, "paths": [text]}],
                         "data.seq_len": 32, "data.batch_size": 4, "data.total_tokens": 32 * 4 * 24,
                         "run.checkpoint_every": 8, "run.eval_every": 8, "run.eval_batches": 1})


@pytest.mark.parametrize("engine_name", ["torch", "jax"])
def test_a_resumed_bpe_run_equals_an_uninterrupted_one(engine_name, spec, tmp_path):
    from engines.registry import get_engine

    spec = spec.replace(engine=engine_name)
    engine = get_engine(engine_name)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    for _ in engine.train(spec, whole):
        pass
    run = engine.train(spec, stopped)
    for _ in itertools.islice(run, 12):  # past the checkpoint at step 8: steps 8-11 are redone
        pass
    run.close()
    assert latest_checkpoint(stopped).name == "step_00000008"
    for _ in engine.train(spec, stopped, resume=True):
        pass
    a, b = read_metrics(whole), read_metrics(stopped)
    assert [r["step"] for r in b] == list(range(spec.total_steps))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("eval_loss") for r in a] == [r.get("eval_loss") for r in b]
    pa, _, info = load_checkpoint(latest_checkpoint(whole))
    pb, _, _ = load_checkpoint(latest_checkpoint(stopped))
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert info["data"]["tokenizer"] == spec.data.tokenizer
