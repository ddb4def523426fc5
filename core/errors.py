"""The project's own error for bad input: the ground floor of every error the CLI answers in one line.

A file, a flag, a spec or an environment variable that the code cannot use as given is an
InputError (or a subclass: SpecError, EnvError, OptionsError, ...) whose message says what and
where; the CLI prints that one line and exits 2 (ladder/errors.py). Any other exception, a KeyError
or a ValueError included, is a bug: the CLI shows its traceback and exits 1. InputError is a
ValueError, so code that catches ValueError around a parse keeps catching it.
"""

from __future__ import annotations


class InputError(ValueError):
    """Input the code cannot use as given (a file, a flag, a spec, a variable); the message names it."""
