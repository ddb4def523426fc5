"""The environment: every variable moe-ladder reads, in one table under one prefix, read here and
nowhere else (tests/core/test_env.py holds the tree to that). Each has a type: a path, a URI, a
flag, or a list of settings `key=value[,key=value...]` that a typed reader validates.

    MOE_LADDER_ROOT          path     the ladder root (default ./.ladder; --root wins)
    MOE_LADDER_TRACKING_URI  URI      the MLflow store (--tracking-uri wins; default $MLFLOW_TRACKING_URI,
                                      then the root's SQLite file)
    MOE_LADDER_CACHE         path     token shards and tokenizers (default ~/.cache/moe-ladder)
    MOE_LADDER_CORPUS        path     the built-in corpus (default $MOE_LADDER_CACHE/corpus)
    MOE_LADDER_TOKENIZERS    path     where a named tokenizer is looked for first
    MOE_LADDER_OPTIONS       settings the engine options over a spec's own (core/options.Options.from_env):
                                      torch_fast, torch_master, torch_compile, torch_ep, torch_dense,
                                      jax_mgpu, jax_mgpu_tiles, cpu_threads
    MOE_LADDER_LIMITS        settings Limits below: ray_timeout_s, claim_stale_s, shard_chunk_bytes
    MOE_LADDER_DEBUG         1        the CLI shows a user error's traceback too (a bug's it always shows)

A bad value is an EnvError (a core.errors.InputError: one line, exit 2) whose message names the
variable and the key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from core.errors import InputError

PREFIX = "MOE_LADDER_"
NAMES = ("ROOT", "TRACKING_URI", "CACHE", "CORPUS", "TOKENIZERS", "OPTIONS", "LIMITS", "DEBUG")


class EnvError(InputError):
    """An environment variable with a value it does not take; the message names it."""


def var(name: str) -> str:
    """The variable's full name (PREFIX + name); a name outside the table is a programming error."""
    if name not in NAMES:
        raise KeyError(f"{PREFIX}{name} is not one of moe-ladder's environment variables ({', '.join(NAMES)})")
    return PREFIX + name


def text(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or None where it is unset or empty."""
    value = (os.environ if env is None else env).get(var(name), "")
    return value or None


def path(name: str, env: Mapping[str, str] | None = None) -> Path | None:
    value = text(name, env)
    return Path(value).expanduser() if value is not None else None


def flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    return text(name, env) not in (None, "0")


def settings(name: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`key=value` pairs separated by commas or spaces, as strings (a typed reader converts them)."""
    raw = text(name, env) or ""
    out: dict[str, str] = {}
    for item in raw.replace(",", " ").split():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise EnvError(f"{var(name)}={raw!r}: {item!r} is not key=value")
        out[key] = value
    return out


def setting_error(name: str, key: str, value: str, why: str) -> EnvError:
    return EnvError(f"{var(name)} {key}={value!r}: {why}")


@dataclass(frozen=True)
class Limits:
    """Waits and sizes a user rarely changes and a test shortens ($MOE_LADDER_LIMITS)."""

    ray_timeout_s: float = 30.0  # how long a submission waits for --address to answer
    claim_stale_s: float = 120.0  # a spec's claim whose heartbeat is older is taken over
    shard_chunk_bytes: int = 8 * 2**20  # input bytes a tokenizer worker reads at a time

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Limits":
        given = settings("LIMITS", env)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in given.items():
            if key not in fields:
                raise setting_error("LIMITS", key, raw, f"not a limit (choose {', '.join(fields)})")
            kind = int if fields[key].type in (int, "int") else float
            try:
                value = kind(raw)
            except ValueError:
                raise setting_error("LIMITS", key, raw, f"not a number") from None
            if not 0 < value < 1e12:
                raise setting_error("LIMITS", key, raw, "must be positive")
            values[key] = value
        return cls(**values)
