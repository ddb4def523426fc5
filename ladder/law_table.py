"""A user's CSV table as the `ladder law` commands read it: the rows `--where` keeps, the columns a
law needs (numeric, finite, positive) and the highest-loss rows `--drop-highest` drops."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.runs.csvio import TableError, read_table
from ladder.errors import LadderError

WHERE_HELP = "keep only these rows: COL=V, COL!=V, COL<V, COL<=V, COL>V, COL>=V, COL=V1,V2 (repeatable, all hold)"


WHERE_PATTERN = re.compile(r"^\s*([^<>!=]+?)\s*(<=|>=|!=|==|=|<|>)\s*(.*?)\s*$")


@dataclass(frozen=True)
class Where:
    """One --where condition: COL=V, COL!=V, COL<V, COL<=V, COL>V, COL>=V; V1,V2,... after = or != is a list."""

    col: str
    op: str
    values: tuple[str, ...]

    @property
    def text(self) -> str:
        joined = ",".join(self.values)
        return joined if self.op == "=" else f"{self.op}{joined}"


def parse_where(where: list[str] | None) -> list[Where]:
    out = []
    for w in where or []:
        m = WHERE_PATTERN.match(w)
        if not m or not m.group(3):
            raise LadderError(f"--where {w!r}: expected COL=VALUE, COL!=VALUE, COL<VALUE, COL<=VALUE, COL>VALUE, "
                              "COL>=VALUE or COL=V1,V2,...")
        col, op, value = m.group(1).strip(), m.group(2), m.group(3)
        op = "=" if op == "==" else op
        values = tuple(v.strip() for v in value.split(",")) if op in ("=", "!=") else (value,)
        if op in ("<", "<=", ">", ">="):
            try:
                float(value)
            except ValueError:
                raise LadderError(f"--where {w!r}: {op} compares numbers; {value!r} is not one") from None
        out.append(Where(col, op, values))
    return out


def where_json(conds: list[Where]) -> dict[str, str]:
    return {c.col: c.text for c in conds}


def apply_where(df: pd.DataFrame, file: Path, where: list[Where]) -> pd.DataFrame:
    for c in where:
        if c.col not in df.columns:
            raise LadderError(f"{file}: --where names column {c.col!r}, which is not in the file "
                              f"(columns: {', '.join(map(repr, df.columns))})")
        num = pd.to_numeric(df[c.col], errors="coerce").to_numpy(dtype=np.float64)
        if c.op in ("<", "<=", ">", ">="):
            v = float(c.values[0])
            if np.isnan(num).any():
                r = int(np.flatnonzero(np.isnan(num))[0])
                raise LadderError(f"{file}: --where {c.col}{c.op}{c.values[0]}: row {r + 1} of {c.col!r} is not a number")
            keep = {"<": num < v, "<=": num <= v, ">": num > v, ">=": num >= v}[c.op]
        else:
            keep = np.zeros(len(df), dtype=bool)
            text = df[c.col].astype(str).str.strip().to_numpy()
            for value in c.values:
                try:
                    v = float(value)
                except ValueError:
                    v = None
                if v is not None and not np.isnan(num).any():
                    keep |= np.isclose(num, v, rtol=1e-9, atol=0.0)
                else:
                    keep |= text == value
            if c.op == "!=":
                keep = ~keep
        df = df[keep]
        if not len(df):
            raise LadderError(f"{file}: no row has {c.col} {'= ' if c.op == '=' else c.op}{c.text.lstrip('<>=!')}")
    return df


def load_table(file: Path, cols: dict[str, str], loss_col: str, drop_highest: int, min_rows: int,
          where: list[tuple[str, str]] = ()):
    """Read the CSV, keep the rows --where selects, validate the named columns (numeric, finite,
    positive), then drop the `drop_highest` highest-loss rows."""
    if drop_highest < 0:
        raise LadderError(f"--drop-highest must be >= 0, got {drop_highest}")
    needed = [*cols.values(), loss_col]
    try:
        if not where:
            df = read_table(file, needed, positive=needed)
        else:
            df = apply_where(read_table(file, []), file, where).reset_index(drop=True)
            missing = [c for c in needed if c not in df.columns]
            if missing:
                raise TableError(f"{file}: missing column(s) {', '.join(map(repr, missing))} "
                                 f"(columns present: {', '.join(map(repr, df.columns))})")
            df = validate_table(df, file, needed)
    except TableError as e:
        raise LadderError(str(e)) from None
    if drop_highest >= len(df):
        raise LadderError(f"{file}: --drop-highest {drop_highest} would drop all {len(df)} rows")
    if drop_highest:
        df = df.sort_values(loss_col, kind="stable").iloc[: len(df) - drop_highest]
    if len(df) < min_rows:
        dropped = f" after dropping {drop_highest}" if drop_highest else ""
        raise LadderError(
            f"{file}: {len(df)} row(s){dropped}, but the law has {min_rows} parameters: need at least {min_rows} rows"
        )
    return df


def validate_table(df: pd.DataFrame, file: Path, cols: list[str]) -> pd.DataFrame:
    for c in cols:
        v = pd.to_numeric(df[c], errors="coerce").to_numpy(dtype=np.float64)
        bad = ~np.isfinite(v) | (v <= 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TableError(f"{file}: column {c!r} must be positive and finite, selected row {i + 1} has {df[c].iloc[i]!r}")
        df[c] = v
    return df
