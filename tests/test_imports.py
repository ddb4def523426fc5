"""The import graph points down the floors (README: How the code is laid out): no loop between
packages, no package importing a floor above it, and in the packages listed in TOP_LEVEL_ONLY no
project import hidden inside a function (where it would dodge a loop instead of removing it)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "engines", "ladder", "analysis", "experiments")
# what each package may import; the CLI (ladder) is the top floor of commands and may call analysis
ALLOWED = {
    "core": set(),
    "engines": {"core"},
    "analysis": {"core", "engines"},
    "ladder": {"core", "engines", "analysis"},
    "experiments": {"core", "engines", "ladder"},
}
TOP_LEVEL_ONLY = ("core", "engines")  # extend as the other packages' function-level imports go
# package edges that still break the floors, each with where it is; the ratchet test below fails
# once one is gone, so that it leaves this list too
PENDING: dict[tuple[str, str], str] = {}


def _imports(pkg: str, root: Path = ROOT):
    """(file, line, imported module, inside a function?) of every project import in a package."""
    for path in sorted((root / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        stack: list[tuple[ast.AST, bool]] = [(tree, False)]
        while stack:
            node, in_function = stack.pop()
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                names = []
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    yield path.relative_to(root), node.lineno, name, in_function
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the import sites (file:line module)."""
    g: dict[str, dict[str, list[str]]] = {p: defaultdict(list) for p in PACKAGES}
    for pkg in PACKAGES:
        for path, line, name, _ in _imports(pkg):
            top = name.split(".")[0]
            if top != pkg and (pkg, top) not in PENDING:
                g[pkg][top].append(f"{path}:{line} {name}")
    return g


def _cycles(g: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    return _find_cycles(g, PACKAGES)


def _find_cycles(g: dict, nodes) -> list[list[str]]:
    found, state = [], {}

    def visit(p: str, path: list[str]) -> None:
        state[p] = "open"
        for q in sorted(g[p]):
            if state.get(q) == "open":
                found.append(path[path.index(q):] + [q])
            elif q not in state:
                visit(q, path + [q])
        state[p] = "done"

    for p in nodes:
        if p not in state:
            visit(p, [p])
    return found


def test_the_package_graph_has_no_loop():
    g = _graph()
    loops = _cycles(g)
    detail = [f"{' -> '.join(c)} (" + "; ".join(s for a, b in zip(c, c[1:]) for s in g[a][b][:3]) + ")" for c in loops]
    assert not loops, "package-level import loops:\n" + "\n".join(detail)


def test_each_package_imports_only_the_floors_it_may():
    g = _graph()
    wrong = [f"{pkg} -> {dep}: {g[pkg][dep][0]}" for pkg in PACKAGES for dep in g[pkg] if dep not in ALLOWED[pkg]]
    assert not wrong, "imports up the floors:\n" + "\n".join(wrong)


def test_every_pending_edge_still_exists():
    """A pending exception whose import is gone must leave PENDING (the ratchet only tightens)."""
    present = {(pkg, name.split(".")[0]) for pkg in PACKAGES for _, _, name, _ in _imports(pkg)}
    assert set(PENDING) <= present, f"no longer imported, drop from PENDING: {sorted(set(PENDING) - present)}"


def test_project_imports_sit_at_module_level_in_the_cleaned_packages():
    hidden = [f"{path}:{line} {name}" for pkg in TOP_LEVEL_ONLY for path, line, name, inside in _imports(pkg)
              if inside]
    assert not hidden, "project imports inside functions:\n" + "\n".join(hidden)


def test_the_walk_tells_module_level_imports_from_function_level_ones(tmp_path):
    """The checks above cannot pass vacuously: the walker finds both kinds, and only project ones."""
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "m.py").write_text(
        "import json\nfrom core.spec import Spec\n\nclass A:\n    def f(self):\n        from ladder import ledger\n")
    found = sorted((line, name, inside) for _, line, name, inside in _imports("engines", tmp_path))
    assert found == [(2, "core.spec", False), (6, "ladder", True)]
    g = {"a": {"b": ["x"]}, "b": {"a": ["y"]}}
    assert _find_cycles(g, ("a", "b")) == [["a", "b", "a"]]
