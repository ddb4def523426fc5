"""The import graph points down the floors (README: How the code is laid out): no loop between
packages, no package importing a floor above it, and no project import hidden inside a function
(where it would dodge a loop instead of removing it), except where it keeps a heavy third-party
library (HEAVY) out of a process that does not need it: the CLI imports every command module to
build its parser, and `ladder --help` should not pay for scipy or torch."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "engines", "ladder", "analysis", "experiments", "bench")
# what each package may import; the CLI (ladder) is the top floor of commands and may call analysis;
# bench (benchmarks and the fault suite) stands on all of them and nothing stands on it
ALLOWED = {
    "core": set(),
    "engines": {"core"},
    "analysis": {"core", "engines"},
    "ladder": {"core", "engines", "analysis"},
    "experiments": {"core", "engines", "ladder"},
    "bench": {"core", "engines", "analysis", "ladder", "experiments"},
}
TOP_LEVEL_ONLY = ("core", "engines", "ladder", "analysis")
PRODUCT = ("core", "engines", "ladder", "analysis", "experiments")
MAX_LINES = 500  # a product module longer than this is split by concern
# product modules still over MAX_LINES (lines when listed); the ratchet test fails once one is not
OVERSIZE: dict[str, int] = {}
# inside analysis/, the same rule by concern: the readers of runs and the fits' warnings at the bottom,
# laws and curves on them, the forecast on those, the monitor reads a forecast, a replan reads the
# monitor; report and fitplots (modules at the top of analysis/) may import any of them
ANALYSIS_ALLOWED = {
    "fitwarn": set(),
    "runs": set(),
    "laws": {"fitwarn"},
    "curves": {"fitwarn"},
    "forecast": {"fitwarn", "runs", "laws", "curves"},
    "monitor": {"runs", "forecast"},
    "replan": {"fitwarn", "runs", "laws", "curves", "forecast", "monitor"},
}
# third-party libraries whose import costs a process real time (scipy ~0.6 s, torch ~1 s on the
# test machine): a project module that pulls one in may be imported inside a function, where the
# CLI (ladder.cli and every ladder.commands module) does not pull it in already
HEAVY = {"scipy", "matplotlib", "torch", "jax", "jaxlib", "optax", "ray", "mlflow", "triton"}
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
                # `from pkg import mod` imports the module pkg.mod where there is one
                subs = [f"{node.module}.{a.name}" for a in node.names
                        if _module_file(f"{node.module}.{a.name}", root) is not None]
                names = subs or [node.module]
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


def _analysis_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """concern of analysis/ (a subpackage, or a module at its top) -> concern it imports -> sites."""
    g: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path, line, name, _ in _imports("analysis", root):
        parts = name.split(".")
        if parts[0] != "analysis" or len(parts) < 2 or len(path.parts) < 2:
            continue
        src = path.parts[1].removesuffix(".py")
        if src != parts[1]:
            g[src][parts[1]].append(f"{path}:{line} {name}")
    return g


def test_analysis_concerns_import_only_the_floors_they_may():
    g = _analysis_graph()
    assert set(ANALYSIS_ALLOWED) >= {p.name for p in (ROOT / "analysis").iterdir() if (p / "__init__.py").is_file()}
    wrong = [f"analysis.{src} -> analysis.{dst}: {sites[0]}" for src, deps in g.items() if src in ANALYSIS_ALLOWED
             for dst, sites in deps.items() if dst not in ANALYSIS_ALLOWED[src]]
    assert not wrong, "imports up the floors of analysis/:\n" + "\n".join(wrong)
    assert not _find_cycles(g, sorted(g)), _find_cycles(g, sorted(g))


def test_every_pending_edge_still_exists():
    """A pending exception whose import is gone must leave PENDING (the ratchet only tightens)."""
    present = {(pkg, name.split(".")[0]) for pkg in PACKAGES for _, _, name, _ in _imports(pkg)}
    assert set(PENDING) <= present, f"no longer imported, drop from PENDING: {sorted(set(PENDING) - present)}"


def _module_file(name: str, root: Path = ROOT) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=None)
def _top_level_imports(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(project modules, third-party top-level packages) a project module imports at module
    level (`from pkg import mod` names the module pkg.mod where there is one)."""
    path = _module_file(name)
    if path is None:
        return (), ()
    project, other = set(), set()
    tree = ast.parse(path.read_text(), str(path))
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        found = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _module_file(f"{node.module}.{a.name}") is not None]
        for mod in found:
            (project if mod.split(".")[0] in PACKAGES else other).add(mod.split(".")[0] if mod.split(".")[0]
                                                                       not in PACKAGES else mod)
        stack.extend(ast.iter_child_nodes(node))
    return tuple(sorted(project)), tuple(sorted(other))


def _closure(names) -> set[str]:
    """Every third-party top-level package the module-level imports of `names` reach."""
    seen, libs, todo = set(), set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # a module imports its packages
        project, other = _top_level_imports(name)
        todo.extend(project)
        libs.update(other)
    return libs


def _cli_closure() -> set[str]:
    commands = sorted(p.stem for p in (ROOT / "ladder" / "commands").glob("*.py") if p.stem != "__init__")
    return _closure(["ladder.cli", *[f"ladder.commands.{c}" for c in commands]])


def test_project_imports_sit_at_module_level_unless_they_keep_a_heavy_library_out():
    cli = _cli_closure()
    hidden = [f"{path}:{line} {name}" for pkg in TOP_LEVEL_ONLY for path, line, name, inside in _imports(pkg)
              if inside and not (_closure([name]) & HEAVY) - cli]
    assert not hidden, "project imports inside functions that spare no heavy library:\n" + "\n".join(hidden)


def _own_closure(path: Path) -> set[str]:
    """Every third-party package a script's own module-level imports reach (a bench script is run
    as a file, so its module-level imports are the ones every run of it pays for)."""
    tree = ast.parse(path.read_text(), str(path))
    project, libs = set(), set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _module_file(f"{node.module}.{a.name}") is not None]
        else:
            continue
        for name in names:
            (project if name.split(".")[0] in PACKAGES else libs).add(name if name.split(".")[0] in PACKAGES
                                                                     else name.split(".")[0])
    return libs | _closure(project)


def test_bench_imports_sit_at_module_level_unless_they_keep_a_heavy_library_out():
    """A benchmark imports a heavy library inside the function that needs it (a JAX row need not
    pay for torch); every other project import sits at the top of the script."""
    hidden = []
    for path, line, name, inside in _imports("bench"):
        if inside and not (_closure([name]) & HEAVY) - _own_closure(ROOT / path):
            hidden.append(f"{path}:{line} {name}")
    assert not hidden, "bench imports inside functions that spare no heavy library:\n" + "\n".join(hidden)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_product_module_is_longer_than_the_limit():
    long = {str(p.relative_to(ROOT)): _lines(p) for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))
            if _lines(p) > MAX_LINES}
    new = {k: v for k, v in long.items() if k not in OVERSIZE}
    assert not new, f"modules over {MAX_LINES} lines (split them by concern): {new}"
    assert set(OVERSIZE) <= set(long), f"now within {MAX_LINES} lines, drop from OVERSIZE: {sorted(set(OVERSIZE) - set(long))}"


def test_the_cli_alone_imports_no_heavy_library():
    """The lazy imports above are worth keeping only while the CLI's own imports stay light."""
    assert not _cli_closure() & HEAVY, sorted(_cli_closure() & HEAVY)


def test_the_closure_walk_sees_heavy_libraries_behind_project_modules():
    assert "torch" in _closure(["engines.torch.model"]) and "scipy" in _closure(["analysis.laws.fit"])
    assert "torch" not in _closure(["core.spec"])


def test_the_walk_tells_module_level_imports_from_function_level_ones(tmp_path):
    """The checks above cannot pass vacuously: the walker finds both kinds, and only project ones."""
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "m.py").write_text(
        "import json\nfrom core.spec import Spec\n\nclass A:\n    def f(self):\n        from ladder import ledger\n")
    found = sorted((line, name, inside) for _, line, name, inside in _imports("engines", tmp_path))
    assert found == [(2, "core.spec", False), (6, "ladder", True)]
    g = {"a": {"b": ["x"]}, "b": {"a": ["y"]}}
    assert _find_cycles(g, ("a", "b")) == [["a", "b", "a"]]
