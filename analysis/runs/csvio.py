"""Reading user CSVs for the fitters, with errors that name the problem.

API (kept small on purpose):

    read_table(path, required_cols, *, positive=(), increasing=None, min_rows=1) -> pd.DataFrame

- `path`: a CSV file with a header row. Extra columns are kept and never checked.
- `required_cols`: columns that must exist; each must be numeric with no NaN/empty cell.
- `positive`: columns (a subset of required_cols) whose every value must be > 0.
- `increasing`: a column whose values must be strictly increasing (e.g. "step").
- `min_rows`: fewest data rows accepted.

Returns the DataFrame with the required columns cast to float64 (all other columns as read).
Every problem raises `TableError` (a ValueError, so the CLI prints it as a one-line user error
with exit code 2); its message names the file, the column and the first offending row (1-based
data row, the header not counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd

from core.errors import InputError

__all__ = ["TableError", "read_table"]


class TableError(InputError):
    """A CSV that cannot be used as given; the message says which file, column and row."""


def _first_bad(mask_R: np.ndarray) -> int:
    return int(np.flatnonzero(mask_R)[0]) + 1


def read_table(
    path: str | Path,
    required_cols: Iterable[str],
    *,
    positive: Iterable[str] = (),
    increasing: str | None = None,
    min_rows: int = 1,
) -> pd.DataFrame:
    path = Path(path)
    required = list(dict.fromkeys(required_cols))
    positive = list(positive)
    for c in positive + ([increasing] if increasing else []):
        if c not in required:
            required.append(c)

    if not path.exists():
        raise TableError(f"{path}: no such file")
    if path.is_dir():
        raise TableError(f"{path}: is a directory, expected a CSV file")
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise TableError(f"{path}: file is empty (expected a CSV with a header row)") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise TableError(f"{path}: not a readable CSV ({str(e).strip().splitlines()[0]})") from None

    df.columns = [str(c).strip() for c in df.columns]
    twice = sorted({c for c in df.columns if list(df.columns).count(c) > 1})
    if twice:
        raise TableError(f"{path}: column(s) {', '.join(repr(c) for c in twice)} appear more than once in the header")
    missing = [c for c in required if c not in df.columns]
    if missing:
        have = ", ".join(repr(c) for c in df.columns) or "none"
        raise TableError(
            f"{path}: missing column(s) {', '.join(repr(c) for c in missing)} (columns present: {have})"
        )

    for c in required:
        col = pd.to_numeric(df[c], errors="coerce")
        not_numeric_R = col.isna().to_numpy() & df[c].notna().to_numpy()
        if not_numeric_R.any():
            r = _first_bad(not_numeric_R)
            raise TableError(f"{path}: column {c!r} row {r}: value {df[c].iloc[r - 1]!r} is not a number")
        values_R = col.to_numpy(dtype=np.float64)
        nan_R = np.isnan(values_R)
        if nan_R.any():
            raise TableError(
                f"{path}: column {c!r} has {int(nan_R.sum())} missing/NaN value(s), first at row {_first_bad(nan_R)}"
            )
        inf_R = np.isinf(values_R)
        if inf_R.any():
            raise TableError(f"{path}: column {c!r} row {_first_bad(inf_R)}: value is infinite")
        df[c] = values_R

    if len(df) < min_rows:
        raise TableError(f"{path}: {len(df)} data row(s), need at least {min_rows}")

    for c in positive:
        bad_R = df[c].to_numpy() <= 0
        if bad_R.any():
            r = _first_bad(bad_R)
            raise TableError(
                f"{path}: column {c!r} must be positive, row {r} has {df[c].iloc[r - 1]:g}"
            )

    if increasing is not None:
        v_R = df[increasing].to_numpy()
        bad_R = np.diff(v_R) <= 0
        if bad_R.any():
            r = _first_bad(bad_R) + 1
            raise TableError(
                f"{path}: column {increasing!r} must be strictly increasing (sorted, no repeats); "
                f"row {r} has {v_R[r - 1]:g} after {v_R[r - 2]:g}"
            )
    return df
