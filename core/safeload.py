"""Reading YAML, JSON and TOML that comes from outside (specs, other stacks' configs, settings,
metric-name maps, a W&B run's config) within limits, so a hostile or broken file is refused in one
line instead of exhausting memory or the interpreter's stack.

    text = read_text(path)                       # at most MAX_BYTES
    data = parse_yaml(text, origin=str(path))    # or parse_json, parse_toml
    data = load_file(path)                       # both, by the file's suffix

The limits, each refused with an InputLimitError (a ValueError) naming the file and the limit:

- MAX_BYTES (16 MiB): a file's size. Configs and specs are kilobytes.
- MAX_DEPTH (100): nesting of lists and mappings, checked before anything recursive runs: for
  YAML while the node graph is composed (and again through aliases), for JSON by a scan of the
  text's brackets outside strings before json decodes it, for TOML on the parsed value (tomllib's
  own recursion stops at the interpreter's limit, and that RecursionError is refused the same way).
- MAX_ALIASES (100): YAML alias nodes (`*name`) in one document.
- MAX_NODES (200,000): YAML values counted with every alias expanded, checked on the composed node
  graph before any Python object is built; a "billion laughs" file (a few lines whose aliases
  expand to millions of values) stops here. A YAML alias to its own ancestor is refused too.
"""

from __future__ import annotations

import json
import re
import sys
from itertools import accumulate, repeat
from operator import sub
from pathlib import Path
from typing import Any

import yaml

from core.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_BYTES = 16 * 2**20
MAX_DEPTH = 100
MAX_ALIASES = 100
MAX_NODES = 200_000

__all__ = ["MAX_ALIASES", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "InputLimitError", "load_file", "parse_json",
           "parse_toml", "parse_yaml", "read_text"]


class InputLimitError(InputError):
    """A file beyond one of this module's limits; the message names the file and the limit."""


def _too_deep(origin: str) -> InputLimitError:
    return InputLimitError(f"{origin}: nested more than {MAX_DEPTH} levels deep (the limit for a config file)")


def read_text(path: str | Path) -> str:
    """A file's text (UTF-8), refused when it holds more than MAX_BYTES."""
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise InputLimitError(f"{path}: larger than {MAX_BYTES // 2**20} MiB (the limit for a config file)")
    return data.decode("utf-8")


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that composes at most MAX_DEPTH levels and MAX_ALIASES aliases, and
    measures the node graph (aliases expanded) before a Python object is built."""

    origin = "<yaml>"

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise InputLimitError(f"{self.origin}: more than {MAX_ALIASES} YAML aliases (the limit for a "
                                      "config file)")
            return super().compose_node(parent, index)
        if not self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent):
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _too_deep(self.origin)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _measure(node, self.origin)
        return node


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _measure(root: yaml.Node, origin: str) -> None:
    """Refuses a node graph that, aliases expanded, holds more than MAX_NODES values, nests more
    than MAX_DEPTH levels, or refers to its own ancestor. Iterative: a deep graph cannot recurse."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) with aliases expanded
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            kids = [done[id(k)] for k in _children(node)]
            size = 1 + sum(s for s, _ in kids)
            depth = (not isinstance(node, yaml.ScalarNode)) + max((d for _, d in kids), default=0)
            if size > MAX_NODES:
                raise InputLimitError(f"{origin}: YAML aliases expand to more than {MAX_NODES:,} values (the "
                                      "limit for a config file)")
            if depth > MAX_DEPTH:
                raise _too_deep(origin)
            open_.discard(key)
            done[key] = (size, depth)
        elif key in open_:
            raise InputLimitError(f"{origin}: a YAML alias refers to a value that contains it")
        elif key not in done:
            open_.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node) if id(k) not in done)


def parse_yaml(text: str, origin: str = "<yaml>") -> Any:
    """yaml.safe_load within the limits; a single document."""
    loader = _BoundedLoader(text)
    loader.origin = origin
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_ESCAPE = re.compile(r"\\.", re.S)
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_LEVEL = bytes.maketrans(b"[]{}", b"\x02\x00\x02\x00")


def json_depth(text: str) -> int:
    """How deep a JSON text's arrays and objects nest, from its brackets outside strings (linear
    in the text, nothing recursive; the text need not be valid JSON)."""
    # escapes first (so that \" does not end a string), then strings, then all but brackets
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text)))
    if not brackets:
        return 0
    steps = brackets.encode("ascii").translate(_LEVEL)  # an opening bracket 2, a closing one 0
    return max(accumulate(map(sub, steps, repeat(1))))  # running depth: +1 per opening, -1 per closing


def parse_json(text: str, origin: str = "<json>") -> Any:
    """json.loads within the depth limit (checked on the text, before decoding)."""
    if json_depth(text) > MAX_DEPTH:
        raise _too_deep(origin)
    return json.loads(text)


def _depth(value: Any) -> int:
    """How deep a parsed value's lists and dicts nest (iterative)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        kids = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if kids is None:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            break
        stack.extend((k, d + 1) for k in kids)
    return deepest


def parse_toml(text: str, origin: str = "<toml>") -> dict:
    """tomllib.loads within the depth limit."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise _too_deep(origin) from None
    if _depth(data) > MAX_DEPTH:
        raise _too_deep(origin)
    return data


def load_file(path: str | Path, kind: str | None = None) -> Any:
    """A file's value within the limits: kind "yaml", "json" or "toml", else from the suffix
    (.yaml/.yml, .toml, anything else JSON)."""
    p = Path(path)
    if kind is None:
        kind = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}.get(p.suffix.lower(), "json")
    parse = {"yaml": parse_yaml, "json": parse_json, "toml": parse_toml}[kind]
    return parse(read_text(p), str(p))


def read_document(path: str | Path, error: type[Exception]) -> Any | None:
    """A JSON document a command wrote (compare.json, replan.json), within the limits: None when
    absent; `error` naming the file and the problem when it is over a limit or not readable JSON."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return load_file(path, "json")
    except InputLimitError as e:
        raise error(str(e)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not readable JSON ({e}); rerun the command that writes it") from None


def kind_error(value: Any, kinds: tuple[type, ...]) -> str | None:
    """None when `value` is of one of `kinds` (a bool counts only where bool is named, null only
    where type(None) is), else the end of a one-line refusal: "is str, not int or null"."""
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return None
    return f"is {type(value).__name__}, not {' or '.join('null' if k is type(None) else k.__name__ for k in kinds)}"

