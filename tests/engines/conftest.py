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
