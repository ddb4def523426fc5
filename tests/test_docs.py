"""The documentation: the site builds with `mkdocs build --strict` (no broken link, anchor or nav
entry), its CLI reference names every command of the typer app, and README stays a short guide
whose links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from ladder.cli import app

ROOT = Path(__file__).resolve().parents[1]


def command_paths(command, prefix: str = "ladder") -> list[str]:
    """'ladder compare', 'ladder law fit', ...: every leaf command of the app."""
    subs = getattr(command, "commands", None)
    if not subs:
        return [prefix]
    return [p for name, sub in subs.items() for p in command_paths(sub, f"{prefix} {name}")]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_site_builds_strict(site):
    assert (site / "index.html").exists() and (site / "guides" / "data" / "index.html").exists()


@pytest.mark.slow
def test_the_cli_reference_names_every_command(site):
    page = (site / "cli" / "index.html").read_text()
    paths = command_paths(typer.main.get_command(app))
    assert len(paths) > 10
    missing = [p for p in paths if f"<code>{p}</code>" not in page]
    assert not missing, missing


@pytest.mark.slow
def test_the_monitor_thresholds_table_is_generated(site):
    page = (site / "guides" / "monitoring" / "index.html").read_text()
    assert "generated: monitor settings" not in page and "<code>drop_budget</code>" in page


def test_readme_is_short_with_both_commands_up_front():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    head = "\n".join(lines[:60])
    assert "make demo" in head and "make test" in head


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert targets
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, missing
