"""Ray Train launch of a spec with hardware.workers > 1: the layout and feasibility checks (fast)."""

from __future__ import annotations

import pytest

from core.spec import Spec
from ladder.controller import check_feasible, resources_of
from ladder.errors import LadderError
from ladder.presets import micro_spec
from ladder.train_launch import LaunchError, check_layout, infeasible, is_multi_worker

MESH = {"model.ep_size": 2, "model.dispatch": "capacity", "hardware.workers": 4, "hardware.task_cpus": 1}


def _node(cpus: float) -> dict:
    return {"Resources": {"CPU": cpus}, "Alive": True}


def test_the_worker_count_is_not_part_of_the_spec_id():
    one = micro_spec("m", **{k: v for k, v in MESH.items() if not k.startswith("hardware")})
    assert micro_spec("m", **MESH).id == one.id
    assert is_multi_worker(micro_spec("m", **MESH)) and not is_multi_worker(one)


def test_four_one_cpu_workers_fit_two_nodes_of_two_cpus_packed_but_not_strictly_packed():
    nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert infeasible(micro_spec("m", **MESH), nodes) is None
    why = infeasible(micro_spec("m", **MESH, **{"hardware.placement": "STRICT_PACK"}), nodes)
    assert "asks for 4 workers of 1 CPU (STRICT_PACK): one node has room for 2" in why


def test_strict_spread_needs_a_node_per_worker():
    why = infeasible(micro_spec("m", **MESH, **{"hardware.placement": "STRICT_SPREAD"}), [{"CPU": 8.0}] * 3)
    assert "4 different nodes has room for 3" in why


def test_the_controller_refuses_workers_the_cluster_can_never_hold_at_once():
    with pytest.raises(LadderError, match="asks for 4 workers of 1 CPU \\(PACK\\): the cluster has room for 3"):
        check_feasible([micro_spec("m", **MESH)], [_node(2), _node(1)])
    check_feasible([micro_spec("m", **MESH)], [_node(2), _node(2)])  # fits: no error


def test_the_launching_task_holds_no_resources_of_its_own():
    assert resources_of(micro_spec("m", **MESH)) == {}
    assert resources_of(micro_spec("m")) == {"CPU": 1.0}


def test_workers_that_form_no_mesh_are_refused_by_name():
    with pytest.raises(LaunchError, match="3 process\\(es\\) do not form a \\(data x expert\\) mesh"):
        check_layout(micro_spec("m", **{**MESH, "hardware.workers": 3}))


def test_several_workers_need_the_torch_engine():
    spec = micro_spec("m", **MESH).replace(engine="jax")
    with pytest.raises(LaunchError, match="needs engine torch"):
        check_layout(spec)


def test_an_unknown_placement_is_a_validation_error_naming_the_field():
    with pytest.raises(Exception, match="placement"):
        Spec.model_validate({**micro_spec("m").model_dump(), "hardware": {"placement": "ANYWHERE"}})


def test_the_plans_memory_per_device_splits_everything_over_a_workers_mesh():
    from core.costs import memory_per_gpu

    one = memory_per_gpu(micro_spec("m", **{"model.ep_size": 2}))
    four = memory_per_gpu(micro_spec("m", **MESH))
    assert four["params_held"] == pytest.approx(one["params_held"] / 4, rel=1e-12)
    assert four == memory_per_gpu(micro_spec("m", **MESH), mesh=(2, 2))


def test_the_controller_refuses_workers_that_form_no_mesh_before_anything_starts():
    with pytest.raises(LadderError, match="3 process\\(es\\) do not form a \\(data x expert\\) mesh"):
        check_feasible([micro_spec("m", **{**MESH, "hardware.workers": 3})], [_node(8)])
