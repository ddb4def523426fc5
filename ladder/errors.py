"""User-facing errors: bad input prints one clear line and exits 2, never a traceback."""

from __future__ import annotations


from pydantic import ValidationError
from rich.console import Console

from core.spec import SpecError, format_validation_error


class LadderError(Exception):
    """A problem with the user's input or environment; the message says what and where."""


USER_ERRORS = (LadderError, SpecError, FileNotFoundError, KeyError, ValueError)


def run_cli(app) -> int:
    err = Console(stderr=True)
    try:
        # without standalone mode, click hands back typer.Exit(n)'s code as the return value
        rv = app(standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except SystemExit as e:  # typer.Exit and friends
        return int(e.code or 0)
    except ValidationError as e:
        err.print(f"[red]error:[/red] invalid spec: {format_validation_error(e)}")
        return 2
    except USER_ERRORS as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        err.print(f"error: {msg}", style="red", highlight=False, markup=False)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            return e.exit_code
        if isinstance(e, click.exceptions.Abort):
            return 130
        raise
