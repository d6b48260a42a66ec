"""Small helpers for experiment reports: markdown tables from pandas frames, result files."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def write_report(results: Path, stem: str, lines: list[str], data: dict) -> None:
    """`results`/`stem`.md (the lines) and `stem`.json (the data), and say so."""
    results.mkdir(exist_ok=True)
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (results / f"{stem}.json").write_text(json.dumps(data, indent=1))
    print(f"wrote {results / stem}.md")
