"""Shared fixtures: a private token cache, tiny specs, experiment files written to tmp_path, and a
local Ray per test module."""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest

# One OpenMP thread a process (the workers, and every subprocess they start, inherit it): the suite
# runs several processes a core, where torch's OpenMP threads spin waiting for each other. Read when
# torch is first imported, which no module has done before this one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA's CPU backend without LLVM's optimisation passes: the suite compiles hundreds of tiny JAX
# steps and runs each a few times, so compiling is most of their cost (a quarter less CPU for the
# JAX engine's test files; the same losses). Subprocesses inherit it; a test that sets its own
# XLA_FLAGS keeps this flag with its own (tests/support.xla_flags).
from tests.support import OPT_FLAG, tiny_changes, xla_flags  # noqa: E402  (after the environment above; imports no torch)

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = xla_flags(OPT_FLAG)

# The longest test files first. `make test` hands each pytest-xdist worker a file at a time in
# collection order (--dist loadfile --no-loadscope-reorder; xdist's own reorder puts the files with
# the most tests first, which left the few-test, long files to the end), so the longest go out
# first and no worker is left alone with a long file at the end. Ordered by each file's time run
# alone on the 2-core machine (the larger of its wall and CPU seconds: a file that waits on Ray or
# a server holds its worker as long as one that computes); files not named keep their order after these.
LONGEST_FIRST = (
    "tests/ladder/test_train_launch_cluster.py",
    "tests/bench/test_bench_scripts.py",
    "tests/engines/test_parallel_mesh.py",
    "tests/engines/test_parallel_launch.py",
    "tests/ladder/test_local.py",
    "tests/analysis/test_sources.py",
    "tests/ladder/test_ladder_csv.py",
    "tests/ladder/test_tracking_server.py",
    "tests/test_cli_errors.py",
    "tests/engines/test_dist_checkpoint_integrity.py",
    "tests/analysis/test_forecast.py",
    "tests/engines/test_parallel_ep.py",
    "tests/ladder/test_controller_interrupt.py",
    "tests/analysis/test_replan.py",
    "tests/ladder/test_controller_cluster.py",
    "tests/analysis/test_h200_ladder.py",
    "tests/analysis/test_curves.py",
    "tests/ladder/test_controller.py",
    "tests/bench/test_faults.py",
    "tests/ladder/test_controller_ep.py",
    "tests/ladder/test_tracking.py",
    "tests/ladder/test_train_lock.py",
    "tests/ladder/test_data_cli.py",
    "tests/analysis/test_wandb_runs.py",
    "tests/engines/test_dist_jax_mesh.py",
    "tests/engines/test_torch_resume.py",
    "tests/ladder/test_wandb_tracking.py",
    "tests/ladder/test_mlflow_ui.py",
    "tests/ladder/test_forecast_refusal.py",
    "tests/engines/test_parity.py",
    "tests/analysis/test_laws.py",
    "tests/ladder/test_replan_cli.py",
    "tests/engines/test_jax_fast.py",
    "tests/ladder/test_rerun_diverged.py",
    "tests/ladder/test_localray.py",
    "tests/analysis/test_sources_paging.py",
    "tests/engines/test_trainer_hardening.py",
    "tests/ladder/test_tracking_kind.py",
    "tests/engines/test_data_engines.py",
    "tests/engines/test_moments.py",
    "tests/engines/test_jax_resume.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole



@pytest.fixture(scope="session", autouse=True)
def _private_token_cache(tmp_path_factory):
    """Engines (and the Ray workers, which inherit the environment) cache tokens here, not in ~."""
    old = os.environ.get("MOE_LADDER_CACHE")
    os.environ["MOE_LADDER_CACHE"] = str(tmp_path_factory.mktemp("moe-ladder-cache"))
    yield
    if old is None:
        os.environ.pop("MOE_LADDER_CACHE", None)
    else:
        os.environ["MOE_LADDER_CACHE"] = old


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, created once: creating the schema takes seconds, so tests
    that are not about creating it start from a copy (see seeded_root)."""
    from ladder import tracking

    root = tmp_path_factory.mktemp("mlflow-template")
    tracking.prepare_store(tracking.default_tracking_uri(root))
    return root / "mlflow.db"


@pytest.fixture
def seeded_root(tmp_path, mlflow_template) -> Path:
    """A ladder root whose MLflow store already exists (a copy of the template)."""
    import shutil

    root = tmp_path / ".ladder"
    root.mkdir()
    shutil.copy(mlflow_template, root / "mlflow.db")
    return root


@pytest.fixture
def write_experiment(tmp_path):
    """write_experiment(name, [(rung, {changes}), ...], steps=30, checkpoint_every=10) -> the path
    of an experiment file of tiny specs."""

    def make(name: str, rungs: list[tuple[str, dict]], steps: int = 30, checkpoint_every: int = 10, hero=None) -> Path:
        base = tiny_changes(steps, checkpoint_every)
        hero_src = "None" if hero is None else f"micro_spec({hero[0]!r}, **{{**BASE, **{hero[1]!r}, 'role': 'hero'}})"
        src = textwrap.dedent(
            f"""
            from ladder.experiment import Experiment
            from ladder.presets import micro_spec

            BASE = {base!r}
            RUNGS = {rungs!r}
            EXPERIMENT = Experiment(
                name={name!r},
                rungs=tuple(micro_spec(n, **{{**BASE, **c}}) for n, c in RUNGS),
                hero={hero_src},
            )
            """
        )
        path = tmp_path / f"{name}.py"
        path.write_text(src)
        return path

    return make


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray (2 CPUs) shared by a test module: Ray takes seconds to start."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield ray
    ray.shutdown()
