"""Shared fixtures for engine tests: a private token cache, so tests never touch ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    old = os.environ.get("MOE_LADDER_CACHE")
    os.environ["MOE_LADDER_CACHE"] = str(tmp_path_factory.mktemp("moe-ladder-cache"))
    yield
    if old is None:
        os.environ.pop("MOE_LADDER_CACHE", None)
    else:
        os.environ["MOE_LADDER_CACHE"] = old


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors: one thread beats two (no spinning, steady on a busy 2-core machine)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
