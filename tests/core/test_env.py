"""core/env.py: moe-ladder reads at most eight environment variables, all under one prefix, and
only there; a bad value is one line naming the variable and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core import env

ROOT = Path(__file__).resolve().parents[2]
# a read of one of our variables anywhere: os.environ[...], .get(...), os.getenv(...)
READ = re.compile(r"""(environ\s*(\.get\(|\[)|getenv\()\s*f?["'](MOE_)?LADDER_""")
NAME = re.compile(r"\b(?:MOE_)?LADDER_[A-Z][A-Z_]*[A-Z]\b")


def _sources(*suffixes: str) -> list[Path]:
    skip = {".venv", ".git", "node_modules"}
    return [p for p in ROOT.rglob("*") if p.suffix in suffixes and p.is_file() and not skip & set(p.parts)]


def test_at_most_eight_names_under_one_prefix():
    assert len(env.NAMES) <= 8 and len(set(env.NAMES)) == len(env.NAMES)
    assert all(env.var(n).startswith(env.PREFIX) for n in env.NAMES)
    with pytest.raises(KeyError):
        env.var("TORCH_EP")


def test_no_module_but_core_env_reads_them():
    """(tests set them for the processes they start; the product reads them through core/env.py)"""
    readers = [f"{p.relative_to(ROOT)}:{i}" for p in _sources(".py")
               if p != ROOT / "core" / "env.py" and p.relative_to(ROOT).parts[0] != "tests"
               for i, line in enumerate(p.read_text().splitlines(), 1) if READ.search(line)]
    assert readers == []


def test_every_name_the_tree_mentions_is_in_the_table():
    allowed = {env.var(n) for n in env.NAMES}
    stale = sorted({f"{p.relative_to(ROOT)}: {m}" for p in _sources(".py", ".sh", ".toml", ".cfg")
                    if p.name != "Makefile" for m in NAME.findall(p.read_text()) if m not in allowed})
    # (a Python name such as tests/analysis/test_forecast.py's LADDER_SRC constant is no variable)
    assert [s for s in stale if not s.endswith("LADDER_SRC")] == []


def test_settings_are_key_value_pairs():
    assert env.settings("OPTIONS", {"MOE_LADDER_OPTIONS": "torch_ep=processes, cpu_threads=1"}) == {
        "torch_ep": "processes", "cpu_threads": "1"}
    assert env.settings("OPTIONS", {}) == {}
    with pytest.raises(env.EnvError, match=r"MOE_LADDER_OPTIONS='fast': 'fast' is not key=value"):
        env.settings("OPTIONS", {"MOE_LADDER_OPTIONS": "fast"})


def test_limits_are_typed_and_a_bad_one_is_named():
    got = env.Limits.from_env({"MOE_LADDER_LIMITS": "ray_timeout_s=3,shard_chunk_bytes=200"})
    assert (got.ray_timeout_s, got.claim_stale_s, got.shard_chunk_bytes) == (3.0, 120.0, 200)
    assert isinstance(got.shard_chunk_bytes, int)
    for raw, why in (("ray_timeout_s=soon", "not a number"), ("claim_stale_s=-1", "must be positive"),
                     ("patience=9", "not a limit")):
        with pytest.raises(env.EnvError, match=rf"MOE_LADDER_LIMITS {raw.split('=')[0]}=.*{why}") as err:
            env.Limits.from_env({"MOE_LADDER_LIMITS": raw})
        assert "\n" not in str(err.value)
