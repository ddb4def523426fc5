"""The `ladder` command. Each module in ladder/commands/ adds its commands through
`register(app)`, so a concern's CLI lives beside nothing else."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Optional

import typer
from typer.core import TyperOption

from ladder import commands
from ladder.errors import run_cli

app = typer.Typer(
    help="Scaling-ladder experiments for mixture-of-experts language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
)

_value_type = getattr(TyperOption, "display_type_rich", None)  # typer versions without it show types as they do


def _flag_has_no_type(self: TyperOption, ctx) -> str | None:
    """--help shows a value's type (<str>, <float>) beside options that take one, nothing beside a flag."""
    return None if self.is_flag else _value_type(self, ctx)


if _value_type is not None:
    TyperOption.display_type_rich = _flag_has_no_type


def package_version() -> str:
    try:
        return version("moe-ladder")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"ladder (moe-ladder) {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    _version: Optional[bool] = typer.Option(None, "--version", callback=_print_version, is_eager=True,
                                            help="print the version and exit"),
) -> None:
    """Scaling-ladder experiments for mixture-of-experts language models."""


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
