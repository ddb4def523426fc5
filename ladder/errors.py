"""User-facing errors: bad input prints one clear line and exits 2; a bug prints its traceback and exits 1.

Only the project's own exception types are user errors: core.errors.InputError and its subclasses
(SpecError, EnvError, OptionsError, CheckpointError, ...), LadderError, pydantic's ValidationError
where the CLI validates input, click's usage errors, and an OSError (its message names the path).
Any other exception, a KeyError, ValueError or TypeError included, is a bug and never a one-liner.
"""

from __future__ import annotations

import traceback

from pydantic import ValidationError
from rich.console import Console

from core import env
from core.errors import InputError
from core.spec import format_validation_error


class LadderError(Exception):
    """A problem with the user's input or environment; the message says what and where."""


# OSError: a path that is a directory where a file is due (or the reverse), no permission, a full
# disk, an unreachable host; its message names the path.
USER_ERRORS = (LadderError, InputError, ValidationError, OSError)
EXIT_USAGE = 2
EXIT_INTERNAL = 1


def one_line(text: str, limit: int = 1000) -> str:
    """Text as a single line (newlines folded), at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe(e: BaseException) -> str:
    """The one line a user error prints (also how the controller names a task's failure)."""
    if isinstance(e, ValidationError):
        return f"invalid spec: {format_validation_error(e)}"
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.strerror:
        names = " -> ".join(str(n) for n in (e.filename, e.filename2) if n is not None)
        return f"{names}: {e.strerror}" if names else e.strerror
    return str(e) or type(e).__name__


def run_cli(app) -> int:
    """Run a typer app as the `ladder` command and return its exit status. $MOE_LADDER_DEBUG=1 shows a
    user error's traceback too (before its line); a bug's traceback is always shown."""
    err = Console(stderr=True, soft_wrap=True)

    def say(msg: str) -> None:
        err.print(f"error: {one_line(msg)}", style="red", highlight=False, markup=False)

    try:
        # without standalone mode, click hands back typer.Exit(n)'s code as the return value
        rv = app(standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except SystemExit as e:  # typer.Exit and friends
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except USER_ERRORS as e:
        if env.flag("DEBUG"):
            traceback.print_exc()
        say(describe(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except Exception as e:  # the CLI's last boundary: click's errors by name; anything else is a bug, shown in full
        # click's exceptions, or those of the copy of click that typer ships (typer._click): by name
        kinds = {c.__name__ for c in type(e).__mro__}
        if "UsageError" in kinds:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            say(e.format_message() + hint)
            return EXIT_USAGE
        if "ClickException" in kinds:
            say(e.format_message())
            return getattr(e, "exit_code", EXIT_INTERNAL)
        if "Abort" in kinds:
            return 130
        traceback.print_exc()
        say(f"internal error (a bug in moe-ladder): {type(e).__name__}: {e}")
        return EXIT_INTERNAL
