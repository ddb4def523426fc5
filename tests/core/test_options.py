"""A spec's options section: validated literals outside the spec's id, read from YAML and from an
experiment file, with $MOE_LADDER_OPTIONS laid over it key by key where the CLI reads it."""

import pytest

from core.options import Options, OptionsError
from core.spec import SpecError, load_spec, save_spec
from engines.options import EngineOptions
from ladder.experiment import Experiment
from ladder.presets import micro_spec

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
