"""Configs and specs from outside are read within limits (core/safeload.py): an alias bomb, a
file nested 10,000 levels deep or one over the size cap is refused in one line naming the file
and the limit, exit 2, no traceback; ordinary files, anchors and merge keys included, still load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from analysis.monitor.flags import MonitorSettings
from analysis.runs.names import MetricNamesError, load_metric_names
from core import safeload
from core.safeload import MAX_BYTES, MAX_DEPTH, InputLimitError, parse_json, parse_toml, parse_yaml
from core.spec import SpecError, load_spec
from ladder.presets import micro_spec
from ladder.stack_config import StackConfigError, load_stack_config
from tests import cli_fork

REPO = Path(__file__).resolve().parents[2]
LEVANTER = REPO / "tests" / "ladder" / "data" / "levanter_moe_config.yaml"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def billion_laughs(levels: int = 6, width: int = 10) -> str:
    """The classic: `width` strings, then `levels` lists of `width` aliases to the list before
    (10**6 strings from a file of 400 bytes)."""
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def deep_yaml(n: int = 10_000) -> str:
    return "model: " + "[" * n + "1" + "]" * n + "\n"


def deep_json(n: int = 10_000) -> str:
    return '{"model": ' + '{"a": ' * n + "1" + "}" * n + "}"


def _one_line_refusal(r: subprocess.CompletedProcess, *words: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert "internal error" not in lines[0] and "Traceback" not in r.stderr, lines[0]
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def test_an_alias_bomb_given_to_spec_from_run_is_refused_in_one_line(tmp_path):
    config, out = tmp_path / "train_lm.yaml", tmp_path / "spec.yaml"
    config.write_text(billion_laughs())
    r = cli_fork.ladder("spec", "from-run", "--config", config, "--name", "x", "--stack", "levanter", "--out", out,
                        cwd=tmp_path, env=ENV, timeout=120)
    _one_line_refusal(r, str(config), "aliases", f"{safeload.MAX_NODES:,}")
    assert not out.exists()


def test_an_alias_bomb_given_to_validate_is_refused_in_one_line(tmp_path):
    spec = tmp_path / "bomb.yaml"
    spec.write_text(billion_laughs())
    _one_line_refusal(cli_fork.ladder("validate", spec, cwd=tmp_path, env=ENV, timeout=120), str(spec), "aliases")


def test_an_alias_bomb_is_refused_without_growing_the_process(tmp_path):
    # a process of its own, so that its peak RSS (getrusage of the children) is this command's alone
    config = tmp_path / "train_lm.yaml"
    config.write_text(billion_laughs())
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True);"
             "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    got = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "ladder.cli", "spec", "from-run",
                          "--config", str(config), "--name", "x", "--out", str(tmp_path / "spec.yaml")],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    rc, peak_kib = map(int, got.stdout.split())
    assert rc == 2, got
    assert peak_kib < 512 * 1024, f"peak RSS {peak_kib // 1024} MiB"  # refused: ~130 MiB; the unguarded load passed 2 GiB


@pytest.mark.parametrize("name,text", [("deep.yaml", deep_yaml()), ("deep.json", deep_json())])
def test_a_spec_nested_ten_thousand_levels_is_refused_in_one_line(tmp_path, name, text):
    spec = tmp_path / name
    spec.write_text(text)
    _one_line_refusal(cli_fork.ladder("validate", spec, cwd=tmp_path, env=ENV, timeout=120), str(spec),
                      f"more than {MAX_DEPTH} levels")


@pytest.mark.parametrize("name,text", [("deep.yaml", deep_yaml()), ("deep.json", deep_json()),
                                       ("deep.toml", "[model]\nx = " + "[" * 10_000 + "1" + "]" * 10_000 + "\n")])
def test_a_stack_config_nested_ten_thousand_levels_is_refused_in_one_line(tmp_path, name, text):
    config, out = tmp_path / name, tmp_path / "spec.yaml"
    config.write_text(text)
    r = cli_fork.ladder("spec", "from-run", "--config", config, "--name", "x", "--out", out, cwd=tmp_path,
                        env=ENV, timeout=120)
    _one_line_refusal(r, str(config), f"more than {MAX_DEPTH} levels")
    assert not out.exists()


def test_a_spec_file_over_the_size_cap_is_refused_in_one_line(tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text("# " + "x" * MAX_BYTES + "\n")
    _one_line_refusal(cli_fork.ladder("validate", spec, cwd=tmp_path, env=ENV, timeout=120), str(spec), "16 MiB")


def test_a_yaml_alias_to_its_own_ancestor_is_refused():
    with pytest.raises(InputLimitError, match="contains it"):
        parse_yaml("a: &a [1, *a]\n", "loop.yaml")


@pytest.mark.parametrize("reader,error", [
    (load_spec, SpecError),
    (load_stack_config, StackConfigError),
    (load_metric_names, MetricNamesError),
    (MonitorSettings.load, ValueError),
])
def test_every_yaml_reader_refuses_an_alias_bomb_naming_the_file(tmp_path, reader, error):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs())
    with pytest.raises(error, match="aliases expand"):
        reader(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_ordinary_spec_still_loads(tmp_path, suffix):
    spec = micro_spec("ordinary")
    path = tmp_path / f"ordinary{suffix}"
    path.write_text(spec.to_yaml() if suffix == ".yaml" else spec.to_json())
    assert load_spec(path) == spec


def test_anchors_aliases_and_merge_keys_read_as_safe_load_reads_them():
    text = ("base: &base {lr: 0.001, betas: &b [0.9, 0.95]}\n"
            "optim: {<<: *base, lr: 0.002}\nother: *b\nlists: [*b, *b, *b]\n")
    assert parse_yaml(text, "anchors.yaml") == yaml.safe_load(text)


def test_a_levanter_config_still_loads_as_before():
    assert load_stack_config(LEVANTER) == yaml.safe_load(LEVANTER.read_text())


def test_the_limits_are_exact_at_the_edge():
    at, over = MAX_DEPTH, MAX_DEPTH + 1
    assert parse_json("[" * at + "]" * at, "ok.json") is not None
    assert parse_yaml("[" * at + "]" * at, "ok.yaml") is not None
    assert parse_toml("x = " + "[" * (at - 1) + "]" * (at - 1), "ok.toml") is not None  # the table is a level
    for parse, text in ((parse_json, "[" * over + "]" * over), (parse_yaml, "[" * over + "]" * over),
                        (parse_toml, "x = " + "[" * at + "]" * at)):
        with pytest.raises(InputLimitError, match=f"more than {MAX_DEPTH} levels"):
            parse(text, "deep")


def test_brackets_inside_json_strings_are_not_nesting():
    text = json.dumps({"a": "[" * 500 + '\\"{' * 500, "b": [[1]]})
    assert safeload.json_depth(text) == 3 and parse_json(text)["b"] == [[1]]
