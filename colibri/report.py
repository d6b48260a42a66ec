"""Small helpers for experiment reports: markdown tables from pandas frames."""

from __future__ import annotations

import math

import pandas as pd


def _cell(v, floatfmt: str) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else format(v, floatfmt)
    return str(v)


def markdown_table(df: pd.DataFrame, floatfmt: str = ".2f", index: bool = True) -> str:
    """A GitHub-style markdown table of `df` (index as the first column when `index`)."""
    cols = ([df.index.name or ""] if index else []) + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for key, row in df.iterrows():
        cells = ([str(key)] if index else []) + [_cell(v, floatfmt) for v in row.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
