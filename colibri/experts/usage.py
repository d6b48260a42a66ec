"""`.coli_usage`: per-expert cumulative selection counts, read at start, rewritten atomically."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from colibri.files import write_atomic


def write_usage(path: str | Path, counts: np.ndarray, engine_id: int = 0) -> None:
    """Lines `-1 <layers> <experts>`, `-2 1 <engine_id>`, then `<layer> <expert> <count>` (> 0).

    Written atomically (`files.write_atomic`): a crash or a full disk never leaves a torn file.
    """
    path = Path(path)
    rows, cols = counts.shape
    lines = [f"-1 {rows} {cols}", f"-2 1 {engine_id}"]
    for layer, expert in zip(*np.nonzero(counts), strict=True):
        lines.append(f"{layer} {expert} {int(counts[layer, expert])}")
    write_atomic(path, ("\n".join(lines) + "\n").encode())


def read_usage(path: str | Path, rows: int, cols: int) -> np.ndarray:
    """Counts [rows, cols] from a usage file; zeros if absent, a different shape, or unreadable."""
    counts = np.zeros((rows, cols), np.int64)
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, UnicodeDecodeError, OSError):
        return counts
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 3 or not all(p.lstrip("-").isdigit() for p in parts):
            continue
        a, b, c = (int(p) for p in parts)
        if a == -1 and (b, c) != (rows, cols):
            return np.zeros((rows, cols), np.int64)  # another model's usage
        if 0 <= a < rows and 0 <= b < cols and c > 0:
            counts[a, b] = c
    return counts
