"""Shared fixtures: a private token cache, tiny specs, experiment files written to tmp_path, and a
local Ray per test module."""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest

# A micro spec made smaller still: 128 tokens a step, evaluation only at the end.
TINY = {"data.seq_len": 32, "data.batch_size": 4, "run.eval_every": 10**6, "run.eval_batches": 1}


def tiny_changes(steps: int = 30, checkpoint_every: int = 10, **changes) -> dict:
    return {**TINY, "data.total_tokens": 32 * 4 * steps, "run.checkpoint_every": checkpoint_every, **changes}


def tiny_spec(name: str = "tiny", steps: int = 30, checkpoint_every: int = 10, **changes):
    from ladder.presets import micro_spec

    return micro_spec(name, **tiny_changes(steps, checkpoint_every, **changes))


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
