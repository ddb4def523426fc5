"""The CLI tells a bug from bad input: an exception of the project's own types (core.errors.InputError
and its subclasses, LadderError, pydantic's ValidationError, an OSError naming a path) is the user's
input, one line on stderr and exit 2; anything else (a KeyError, ValueError or TypeError a bug
raised) prints its full traceback and exits 1. Each case runs the real `ladder` app in a process of
its own, with one command planted in it that raises what the test names."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.errors import InputError
from ladder.errors import EXIT_INTERNAL, EXIT_USAGE, USER_ERRORS, LadderError

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("core", "engines", "analysis", "ladder")
# project error classes still derived from ValueError itself (their owner has not moved them onto
# core.errors.InputError yet), with where they are; the ratchet test fails once one has moved
NOT_YET_INPUT_ERRORS = {"engines/torch/parallel/layout.py": {"LayoutError"}}
BASE = ("core/errors.py", "InputError")  # the one class that derives from ValueError itself

# the real app, with one more command that raises `exc` (an expression) from a function of its own
PLANTED = textwrap.dedent("""
    import sys
    from ladder.cli import app
    from ladder.errors import run_cli

    @app.command("planted")
    def planted() -> None:
        def bug_deep_inside():
            raise {exc}
        bug_deep_inside()

    sys.argv = ["ladder", "planted"]
    sys.exit(run_cli(app))
    """)


def run(code: str | None = None, args: tuple = (), cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-c", code] if code is not None else [sys.executable, "-m", "ladder.cli", *map(str, args)]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})})


def lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("warning:")]


@pytest.mark.parametrize("exc", ["KeyError('n_layers')", "ValueError('bad shape')", "TypeError('not callable')"])
@pytest.mark.parametrize("debug", ["", "1"])
def test_a_bug_planted_in_a_command_prints_its_traceback_and_exits_1(exc, debug):
    r = run(PLANTED.format(exc=exc), env={"MOE_LADDER_DEBUG": debug})
    kind = exc.split("(")[0]
    assert r.returncode == EXIT_INTERNAL, r.stderr
    assert "Traceback (most recent call last)" in r.stderr and "bug_deep_inside" in r.stderr, r.stderr
    assert f"{kind}: " in r.stderr and "error: internal error (a bug in moe-ladder)" in r.stderr, r.stderr


@pytest.mark.parametrize("exc", ["LadderError('--days must be positive')",
                                 "__import__('core.spec', fromlist=['x']).SpecError('s.yaml: no such spec file')",
                                 "__import__('core.env', fromlist=['x']).EnvError('MOE_LADDER_LIMITS x=1: no such key')",
                                 "FileNotFoundError(2, 'No such file or directory', 'runs/x/metrics.jsonl')"])
def test_the_projects_own_errors_raised_in_a_command_are_one_line_and_exit_2(exc):
    code = PLANTED.format(exc=exc).replace("from ladder.errors import run_cli", "from ladder.errors import LadderError, run_cli")
    r = run(code)
    got = lines(r.stderr)
    assert r.returncode == EXIT_USAGE and len(got) == 1 and got[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr


def test_the_debug_switch_shows_a_user_errors_traceback_before_its_line_still_exit_2():
    code = PLANTED.format(exc="LadderError('--days must be positive')").replace(
        "from ladder.errors import run_cli", "from ladder.errors import LadderError, run_cli")
    r = run(code, env={"MOE_LADDER_DEBUG": "1"})
    assert r.returncode == EXIT_USAGE, r.stderr
    assert "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1] == "error: --days must be positive", r.stderr


@pytest.mark.parametrize("text, phrase", [
    ("model: {n_layers: [1, 2\n", "not valid YAML"),  # a YAML syntax error
    ("name: bad\nmodel: {n_layers: two}\n", "invalid spec"),  # a field of the wrong type
    ("- 1\n- 2\n", "must be a mapping"),
])
def test_a_malformed_spec_file_is_still_one_line_and_exit_2(tmp_path, text, phrase):
    (tmp_path / "bad.yaml").write_text(text)
    r = run(args=("validate", "bad.yaml"), cwd=tmp_path)
    got = lines(r.stderr)
    assert r.returncode == EXIT_USAGE and len(got) == 1 and got[0].startswith("error: ") and phrase in got[0], r.stderr
    assert "Traceback" not in r.stderr


def test_only_the_projects_own_types_are_user_errors():
    assert not any(issubclass(KeyError, t) or issubclass(ValueError, t) or issubclass(TypeError, t) for t in USER_ERRORS)
    assert issubclass(InputError, ValueError) and InputError in USER_ERRORS and LadderError in USER_ERRORS


def _value_error_classes() -> dict[str, set[str]]:
    """{module path: names of the classes it derives from ValueError itself} across the product."""
    out: dict[str, set[str]] = {}
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "ValueError"
                                                          for b in node.bases) \
                        and (str(path.relative_to(ROOT)), node.name) != BASE:
                    out.setdefault(str(path.relative_to(ROOT)), set()).add(node.name)
    return out


def test_every_error_class_of_the_product_for_bad_input_is_an_input_error():
    """A class the product derives from ValueError is an error for bad input that the CLI would
    take for a bug: it derives from core.errors.InputError instead (which is a ValueError)."""
    found = _value_error_classes()
    stray = {p: names - NOT_YET_INPUT_ERRORS.get(p, set()) for p, names in found.items()}
    assert not {p: n for p, n in stray.items() if n}, stray
    gone = {p: names - found.get(p, set()) for p, names in NOT_YET_INPUT_ERRORS.items()}
    assert not {p: n for p, n in gone.items() if n}, f"moved onto InputError: take them off NOT_YET_INPUT_ERRORS: {gone}"
