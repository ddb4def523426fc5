"""The `ladder` command. Each module in ladder/commands/ adds its commands through
`register(app)`, so a concern's CLI lives beside nothing else."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import typer

from ladder import commands
from ladder.errors import run_cli

app = typer.Typer(
    help="Scaling-ladder experiments for mixture-of-experts language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _register_all() -> None:
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"ladder.commands.{info.name}")
        if hasattr(mod, "register"):
            mod.register(app)


_register_all()


def main() -> None:
    sys.exit(run_cli(app))


if __name__ == "__main__":
    main()
