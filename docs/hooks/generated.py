"""mkdocs hook: the pages that are generated from the code when the site is built, so they say what
the code does: the CLI reference (cli.md, by typer's own Markdown generator from the app in
ladder/cli.py) and the monitor's thresholds with their defaults (the MONITOR_SETTINGS marker in a
page, from analysis.monitor.watch.MonitorSettings)."""

from __future__ import annotations

import typer
import typer.cli
from mkdocs.structure.files import File, Files

from analysis.monitor.watch import MonitorSettings
from ladder.cli import app

MONITOR_SETTINGS = "<!-- generated: monitor settings -->"

INTRO = (
    "Generated from the `ladder` command itself (`ladder/cli.py`, one module a concern under "
    "`ladder/commands/`) when the site is built; `ladder COMMAND --help` prints the same.\n\n"
    "Bad input to any command is one line naming the problem and exit status 2; a bug is one line "
    "and exit status 1 (`MOE_LADDER_DEBUG=1` shows its traceback).\n\n"
)


def full_summaries(command) -> None:
    """Each command's whole first paragraph in its group's list, not click's 45-character cut."""
    for sub in getattr(command, "commands", {}).values():
        if sub.help and not sub.short_help:
            sub.short_help = " ".join(sub.help.strip().split("\n\n")[0].split())
        full_summaries(sub)


def cli_markdown() -> str:
    command = typer.main.get_command(app)
    full_summaries(command)
    ctx = typer.Context(command, info_name="ladder")
    ctx.ensure_object(dict)
    text = typer.cli.get_docs_for_click(obj=command, ctx=ctx, name="ladder", title="CLI reference")
    title, _, rest = text.strip().partition("\n")
    return f"{title}\n\n{INTRO}{rest.lstrip()}\n"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "cli.md", content=cli_markdown()))
    return files


def monitor_settings_table() -> str:
    rows = ["| setting | default | what it is |", "|---|---|---|"]
    for name, field in MonitorSettings.model_fields.items():
        rows.append(f"| `{name}` | `{field.default}` | {field.description or ''} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MONITOR_SETTINGS in markdown:
        markdown = markdown.replace(MONITOR_SETTINGS, monitor_settings_table())
    return markdown
