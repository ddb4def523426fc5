"""Fuzzing the inputs a user writes by hand: spec YAML and the CSV files of `ladder law` and
`ladder curve`. Whatever the bytes, the answer is a spec or one clear error line (exit 2), never a
traceback."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.spec import Spec, SpecError, load_spec
from ladder.presets import micro_spec

pytestmark = pytest.mark.slow  # each property runs its CLI entry 40 times

VALID = micro_spec("fuzz").model_dump(mode="json")

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def cli(*args) -> tuple[int, str]:
    """The CLI's own entry (run_cli) in this process: its exit code and what it wrote to stderr."""
    from ladder.cli import app
    from ladder.errors import run_cli

    err, old = io.StringIO(), sys.argv
    sys.argv = ["ladder", *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = run_cli(app)
    finally:
        sys.argv = old
    return rc, err.getvalue()


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))
    yield prefix


PATHS = [p for p in _paths(VALID) if p]

values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(["../../escape", "a/b", ".", "..", "inf", "nan", "1e15", "true", "", " "]),
)


def _set(doc, path, value):
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _one_error_line(rc: int, err: str) -> None:
    assert rc in (0, 2), err
    assert "Traceback" not in err
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), err


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=4))
def test_a_spec_yaml_with_any_values_is_a_spec_or_one_named_error(tmp_path, edits):
    doc = yaml.safe_load(yaml.safe_dump(VALID))
    for path, value in edits:
        try:
            _set(doc, path, value)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit replaced a parent
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(doc))
    try:
        spec = load_spec(f)
    except SpecError as err:
        assert str(err).startswith(str(f))
    else:
        assert isinstance(spec, Spec)
        # what validates is what the spec says: finite floats, names that stay one path component
        assert "/" not in spec.name and spec.name not in (".", "..")
        assert all(v == v and abs(v) != float("inf") for v in _floats(spec.model_dump()))
    _one_error_line(*cli("validate", f))


def _floats(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _floats(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _floats(v)
    elif isinstance(node, float):
        yield node


@FUZZ
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_as_a_spec_file_are_a_spec_or_one_named_error(tmp_path, raw):
    f = tmp_path / "spec.yaml"
    f.write_bytes(raw)
    _one_error_line(*cli("validate", f))


cells = st.one_of(st.integers(-5, 10**12).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                  st.sampled_from(["", "nan", "inf", "-1", "abc", "1e400", '"', "1,2"]), st.text(max_size=5))


@st.composite
def csv_text(draw, header=("N", "D", "loss")):
    cols = list(draw(st.permutations(header)))
    if draw(st.booleans()):
        cols.append(draw(st.sampled_from(["extra", "loss", "N ", ""])))
    rows = draw(st.lists(st.lists(cells, min_size=len(cols), max_size=len(cols)), max_size=12))
    if draw(st.booleans()):  # ragged rows
        rows = [r[: draw(st.integers(0, len(r)))] for r in rows]
    return "\n".join([",".join(cols), *(",".join(r) for r in rows)]) + draw(st.sampled_from(["", "\n", "\n\n"]))


@FUZZ
@given(text=csv_text())
def test_law_fit_on_any_csv_answers_or_says_what_is_wrong_in_one_line(tmp_path, text):
    f = tmp_path / "runs.csv"
    f.write_text(text)
    _one_error_line(*cli("law", "fit", f, "--params-col", "N", "--tokens-col", "D", "--loss-col", "loss",
                         "--bootstrap", "0", "--no-backtest"))


@FUZZ
@given(text=csv_text(("step", "lr", "loss")), predict=csv_text(("step", "lr")))
def test_curve_fit_on_any_csv_answers_or_says_what_is_wrong_in_one_line(tmp_path, text, predict):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(text)
    b.write_text(predict)
    out = tmp_path / "out"
    rc, err = cli("curve", "fit", "--train", a, "--predict", b, "--out", out)
    _one_error_line(rc, err)
    if rc == 2:
        assert not out.exists()  # a refused fit writes nothing


def test_a_curve_past_the_step_limit_is_refused_in_one_line_before_any_per_step_array(tmp_path):
    """Steps in the billions (a token column given as steps) would take gigabytes of per-step
    arrays: refused at the boundary with one line instead."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("step,lr,loss\n1,0.001,3.0\n2000000000,0.001,2.0\n3000000000,0.0005,1.9\n")
    b.write_text("step,lr\n3000000001,0.0001\n")
    rc, err = cli("curve", "fit", "--train", a, "--predict", b, "--out", tmp_path / "out")
    assert rc == 2 and "past the" in err and len(err.strip().splitlines()) == 1, err
