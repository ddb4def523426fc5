"""A spec's options section: validated literals outside the spec's id, read from YAML and from an
experiment file, with $MOE_LADDER_OPTIONS laid over it key by key where the CLI reads it."""

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from core import env
from core.options import ENV_KEYS, JaxKernelChoices, JaxKernels, Options, OptionsError, TorchKernelChoices, TorchKernels
from core.spec import SpecError, load_spec, save_spec
from engines.options import EngineOptions
from ladder.experiment import Experiment
from ladder.presets import micro_spec

ROOT = Path(__file__).resolve().parents[2]
SET = {"options.torch_ep": "processes", "options.cpu_threads": 2, "options.torch_kernels": {"compile": "none"}}


def test_options_stay_outside_the_spec_id_and_round_trip_through_yaml(tmp_path):
    plain, tuned = micro_spec("a"), micro_spec("a", **SET)
    assert tuned.id == plain.id and "options" not in tuned.identity()
    back = load_spec(save_spec(tuned, tmp_path / "a.yaml"))
    assert back == tuned and back.options.torch_kernels.compile == "none"
    assert "options" not in save_spec(plain, tmp_path / "p.yaml").read_text()  # a spec without them reads as before


def test_a_yaml_options_section_is_validated_and_a_bad_value_named(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(micro_spec("a").to_yaml() + "options:\n  jax_mgpu: 0\n  torch_kernels: {gather: inductor}\n")
    assert load_spec(good).options.jax_mgpu == "0"  # YAML's number 0 is the setting "0"
    bad = tmp_path / "bad.yaml"
    bad.write_text(micro_spec("a").to_yaml() + "options:\n  torch_kernels: {gather: fastest}\n")
    with pytest.raises(SpecError, match=r"options\.torch_kernels\.gather: Input should be 'triton' or 'inductor'"):
        load_spec(bad)
    bad.write_text(micro_spec("a").to_yaml() + "options:\n  torch_fastest: true\n")
    with pytest.raises(SpecError, match=r"options\.torch_fastest: Extra inputs are not permitted"):
        load_spec(bad)


def test_the_environment_wins_over_the_spec_key_by_key():
    spec = micro_spec("a", **SET)
    over = Options.from_env({"MOE_LADDER_OPTIONS": "cpu_threads=1,torch_compile=block"})
    got = EngineOptions.for_spec(spec, over)
    assert (got.cpu_threads, got.torch_ep, got.torch_kernels.compile) == (1, "processes", "block")
    assert got.torch_kernels.gather == EngineOptions().torch_kernels.gather  # unset anywhere: the default
    assert EngineOptions.for_spec(micro_spec("b")) == EngineOptions()


def test_a_bad_environment_setting_is_named():
    with pytest.raises(OptionsError, match=r"MOE_LADDER_OPTIONS torch_compile='all': choose one of block-cudagraphs"):
        Options.from_env({"MOE_LADDER_OPTIONS": "torch_compile=all"})


def test_an_experiments_options_reach_every_spec_under_the_specs_own():
    exp = Experiment(name="x", rungs=(micro_spec("a", **{"options.cpu_threads": 2}), micro_spec("b")),
                     hero=micro_spec("h"), options={"cpu_threads": 1, "torch_ep": "emulate"})
    assert [s.options.set_fields() for s in exp.all_specs()] == [
        {"torch_ep": "emulate", "cpu_threads": 2}, {"torch_ep": "emulate", "cpu_threads": 1},
        {"torch_ep": "emulate", "cpu_threads": 1}]
    assert exp.rungs[0].id == micro_spec("a").id
    with pytest.raises(SpecError, match=r"experiment 'x': invalid options: options.torch_ep: Input should be"):
        Experiment(name="x", rungs=(micro_spec("a"),), options={"torch_ep": "sometimes"})


def test_the_section_and_the_engine_options_are_one_declaration():
    """Each kernel choice a spec's section takes is a field of the engine's declaration, and the
    values it takes are the ones the engine checks: a value one refuses, the other refuses."""
    for choices, kernels in ((TorchKernelChoices, TorchKernels), (JaxKernelChoices, JaxKernels)):
        assert list(choices.model_fields) == [f.name for f in dataclasses.fields(kernels)]
        assert all(v is None for v in choices().model_dump().values())  # unset: the engine's default
    assert list(Options.model_fields) == [f.name for f in dataclasses.fields(EngineOptions)]
    for name in ("gather", "experts", "adamw"):
        with pytest.raises(OptionsError, match=rf"TorchKernels.{name}='fastest': choose one of"):
            TorchKernels(**{name: "fastest"})
        with pytest.raises(ValidationError, match=rf"torch_kernels\.{name}\n  Input should be"):
            Options.model_validate({"torch_kernels": {name: "fastest"}})
        allowed = re.findall(r"'([^']+)'", str(TorchKernelChoices.model_fields[name].annotation))
        assert allowed and all(TorchKernels(**{name: v}) for v in allowed)


def test_the_environment_takes_the_keys_the_declaration_marks_and_converts_them_by_type():
    assert list(ENV_KEYS) == ["torch_fast", "torch_master", "torch_ep", "torch_dense", "torch_compile", "jax_mgpu",
                              "jax_mgpu_tiles", "cpu_threads"]
    assert ENV_KEYS["torch_compile"][0] == ("torch_kernels", "compile")
    got = Options.from_env({"MOE_LADDER_OPTIONS": "torch_fast=0,torch_master=1,cpu_threads=4,jax_mgpu_tiles=t.json"})
    assert got.set_fields() == {"torch_fast": False, "torch_master": True, "cpu_threads": 4, "jax_mgpu_tiles": "t.json"}
    with pytest.raises(OptionsError, match=r"MOE_LADDER_OPTIONS gather='triton': not an option \(choose torch_fast, "
                                           r"torch_master, torch_ep, torch_dense, torch_compile, jax_mgpu, jax_mgpu_tiles or cpu_threads\)"):
        Options.from_env({"MOE_LADDER_OPTIONS": "gather=triton"})  # a kernel choice the declaration keeps off the env
    with pytest.raises(OptionsError, match=r"MOE_LADDER_OPTIONS cpu_threads='0': must be a count >= 1"):
        Options.from_env({"MOE_LADDER_OPTIONS": "cpu_threads=0"})


def test_the_environment_docs_list_the_keys_of_the_declaration():
    """docs/environment.md's table of $MOE_LADDER_OPTIONS keys and the module docstring's list are the
    declaration's keys, and core/env.py's table names them all."""
    doc = (ROOT / "docs" / "environment.md").read_text().split("## Engine options", 1)[1]
    assert sorted(re.findall(r"^\| `([a-z_]+)` \|", doc, re.M)) == sorted(ENV_KEYS)
    import core.options

    listed = re.findall(r"^    ([a-z_]+) {2,}", core.options.__doc__, re.M)
    assert sorted(listed) == sorted(ENV_KEYS)
    assert all(k in env.__doc__ for k in ENV_KEYS)


def test_a_section_survives_pickling_as_a_spec_sent_to_a_worker_does():
    spec = micro_spec("a", **SET)
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and type(back.options) is Options and back.options.torch_kernels.compile == "none"
