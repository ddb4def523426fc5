"""Engine options: the spec's options section with $MOE_LADDER_OPTIONS on top (or built by a caller),
refused by name when a value is bad, and recorded in status.json and every checkpoint (never in the
spec's id)."""

import json

import pytest

from engines.options import EngineOptions, JaxKernels, OptionsError, TorchKernels
from tests.support import tiny_spec


def test_the_environment_switches_set_the_options():
    env = {"MOE_LADDER_OPTIONS": "torch_fast=0,torch_master=1,torch_compile=none,torch_ep=emulate,jax_mgpu=default,"
                                 "cpu_threads=3"}
    o = EngineOptions.from_env(env)
    assert (o.torch_fast, o.torch_master, o.torch_kernels.compile, o.torch_ep, o.jax_mgpu, o.cpu_threads) == (
        False, True, "none", "emulate", "default", 3)
    assert EngineOptions.from_env({}) == EngineOptions()


def test_the_defaults_are_the_values_the_engine_uses():
    k = TorchKernels()
    assert (k.compile, k.gather, k.combine_grad, k.adamw) == ("block-cudagraphs", "triton", "triton", "triton")
    assert k.without_triton().gather == "inductor" and k.without_triton().adamw == "compile"


@pytest.mark.parametrize("setting", ["torch_ep=sometimes", "torch_fast=yes", "cpu_threads=two", "cpu_threads=0",
                                     "torch_compile=all", "jax_mgpu=on", "fastest=1"])
def test_a_bad_switch_is_refused_by_name(setting):
    key, value = setting.split("=")
    with pytest.raises(OptionsError, match=f"MOE_LADDER_OPTIONS {key}={value!r}|MOE_LADDER_OPTIONS {key}={value}:") as err:
        EngineOptions.from_env({"MOE_LADDER_OPTIONS": setting})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", ["loss", "weights", "experts", "gates"])
def test_a_bad_jax_kernel_choice_is_refused_by_name(field):
    with pytest.raises(OptionsError, match=rf"JaxKernels.{field}='fastest': choose ") as err:
        JaxKernels(**{field: "fastest"})
    assert "\n" not in str(err.value)


def test_options_round_trip_through_json():
    o = EngineOptions(torch_ep="processes", cpu_threads=1, torch_kernels=TorchKernels(gather="inductor"),
                      jax_kernels=JaxKernels(experts="autodiff", gates="gather"))
    assert EngineOptions.from_dict(json.loads(json.dumps(o.to_dict()))) == o


def test_a_run_records_its_options_in_status_and_checkpoints(tmp_path):
    from engines.checkpoint import latest_checkpoint, load_checkpoint
    from engines.base import read_status
    from engines.torch.engine import TorchEngine

    spec = tiny_spec(steps=2, checkpoint_every=1, **{"model.ep_size": 1})
    list(TorchEngine("cpu", EngineOptions(cpu_threads=1)).train(spec, tmp_path))
    recorded = read_status(tmp_path)["options"]
    assert recorded["cpu_threads"] == 1 and recorded["torch_fast"] is False  # the GPU kernels are a CUDA path
    assert recorded["torch_dispatch"] == {"dropless": "Dropless", "capacity": "Capacity"}[spec.model.dispatch]
    assert load_checkpoint(latest_checkpoint(tmp_path))[2]["options"] == recorded
    assert "options" not in spec.model_dump()  # the spec's id cannot see them


def test_the_registry_hands_an_engine_its_options():
    from engines.registry import get_engine

    options = EngineOptions(cpu_threads=2)
    assert get_engine("torch", options).options is options
    assert get_engine("jax", options).options is options
    assert get_engine("torch").options is None  # built from the spec's options when it starts


def test_a_bad_jax_tile_file_is_named_before_any_work(tmp_path):
    from engines.jax.engine import JaxEngine

    bad = tmp_path / "tiles.json"
    bad.write_text("[]")
    spec = tiny_spec(steps=2).replace(engine="jax")
    with pytest.raises(ValueError, match=r"MOE_LADDER_OPTIONS jax_mgpu_tiles=.*tiles.json: not a tile file"):
        next(JaxEngine(EngineOptions(jax_mgpu_tiles=str(bad))).train(spec, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_run_records_the_options_its_spec_sets(tmp_path):
    from engines.base import read_status
    from engines.torch.engine import TorchEngine

    spec = tiny_spec(steps=1, **{"model.ep_size": 1}).replace(**{"options.cpu_threads": 1})
    list(TorchEngine("cpu").train(spec, tmp_path))  # no options given: the spec's section
    assert read_status(tmp_path)["options"]["cpu_threads"] == 1
