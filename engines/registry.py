"""Engines are found through the `moe_ladder.engines` entry-point group, so a third engine is a
plugin that declares itself in its own package metadata. The two built-in engines are also known
by module path, so they load from a bare checkout (a GPU box with no install)."""

from __future__ import annotations

import functools
import importlib
from importlib.metadata import entry_points

from core.errors import InputError
from engines.options import EngineOptions

GROUP = "moe_ladder.engines"
BUILTIN = {"torch": "engines.torch.engine:TorchEngine", "jax": "engines.jax.engine:JaxEngine"}


class UnknownEngineError(InputError, KeyError):
    """An engine name no engine is registered under (also a KeyError: a lookup that found nothing)."""

    __str__ = InputError.__str__  # the message as written, not quoted as a KeyError quotes its key


@functools.lru_cache(maxsize=1)  # entry points are read once per process (each scan costs ~25 ms)
def _targets() -> dict[str, str]:
    targets = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        targets[ep.name] = ep.value
    return targets


def engine_names() -> set[str]:
    return set(_targets())


def get_engine(name: str, options: EngineOptions | None = None):
    """An engine instance by name, under `options` (engines/options.py; default: the environment's
    switches when it starts training); an unknown name is an UnknownEngineError that lists the known ones."""
    targets = dict(_targets())
    if name not in targets:
        raise UnknownEngineError(f"unknown engine {name!r}; registered engines: {', '.join(sorted(targets))}")
    module, _, attr = targets[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(options=options) if options is not None else cls()
