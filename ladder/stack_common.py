"""What the stack-config readers share: the error type, typed field access and the final validation."""

from __future__ import annotations

from typing import Any

from core.spec import Spec, SpecError, spec_from_dict

__all__ = ["StackConfigError", "get", "validated"]


class StackConfigError(ValueError):
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
        raise StackConfigError(f"{origin}: {path} is {node!r}, expected a number")
    return node


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
