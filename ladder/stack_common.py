"""What the stack-config readers share: the error type, typed field access and the final validation."""

from __future__ import annotations

import math
from typing import Any

from core.errors import InputError
from core.spec import Spec, SpecError, spec_from_dict

__all__ = ["StackConfigError", "get", "get_int", "get_pair", "validated"]


class StackConfigError(InputError):
    """A stack config that cannot become a spec; the message names the file and field."""


def get(d: Any, path: str, origin: str, default: Any = ..., types: tuple = (int, float)) -> Any:
    node = d
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            if default is ...:
                raise StackConfigError(f"{origin}: no {path} in the config")
            return default
        node = node[part]
    if types == (int, float) and isinstance(node, str):
        try:  # YAML 1.1 reads 6e-4 (no dot) as a string
            node = float(node) if any(ch in node for ch in ".eE") else int(node)
        except ValueError:
            pass
    if types and not (isinstance(node, types) and not isinstance(node, bool)):
        raise StackConfigError(f"{origin}: {path} is {_shown(node)}, expected a number")
    if isinstance(node, float) and not math.isfinite(node):
        raise StackConfigError(f"{origin}: {path} is {node!r}, expected a finite number")
    return node


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def get_int(d: Any, path: str, origin: str, default: Any = ..., minimum: int | None = None) -> Any:
    """A whole number at `path` (1e3 and 1000.0 are 1000), at least `minimum` when given; the
    default as it is when the field is absent."""
    x = get(d, path, origin, default)
    if x is default and default is not ...:
        return x
    if isinstance(x, float):
        if not x.is_integer():
            raise StackConfigError(f"{origin}: {path} is {x!r}, expected a whole number")
        x = int(x)
    if minimum is not None and x < minimum:
        raise StackConfigError(f"{origin}: {path} is {x}, expected at least {minimum}")
    return x


def get_pair(d: Any, path: str, origin: str, default: tuple[float, float]) -> tuple[float, float]:
    """Two finite numbers at `path` (a list such as betas: [0.9, 0.95])."""
    x = get(d, path, origin, default, types=())
    try:
        if not isinstance(x, (list, tuple)):
            raise TypeError
        a, b = (get({"v": v}, "v", origin) for v in x)  # (strings that read as numbers, as get does)
    except (TypeError, ValueError):  # not a sequence of two; or an element that is not a finite number
        raise StackConfigError(f"{origin}: {path} is {_shown(x)}, expected two numbers such as [0.9, 0.95]") from None
    return float(a), float(b)


def validated(spec_dict: dict, overrides: dict[str, Any], origin: str) -> Spec:
    """The spec from the config's fields with the overrides applied, validated once."""
    try:
        node_data = spec_dict
        for dotted, value in overrides.items():
            node = node_data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise StackConfigError(f"{origin}: --set {dotted}: {p} is not a section")
            node[leaf] = value
        return spec_from_dict(node_data, origin)
    except SpecError as e:
        raise StackConfigError(str(e)) from None
