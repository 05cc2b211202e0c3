"""The profile files' CSV layout (Vidur's), for the code that writes them and the code that
reads them: one row per grid point, an op's time in `time_stats.<op>.<stat>` columns
(milliseconds), the stats being min, max, mean, median and std of the repeated runs.
"""
from __future__ import annotations

import csv
import os
import statistics
from pathlib import Path
from typing import Any


def time_stats(ms: list[float]) -> dict[str, float]:
    """The stats of repeated measurements (milliseconds) that a profile stores."""
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms),
            "median": statistics.median(ms), "std": statistics.pstdev(ms)}


def stat_columns(op: str, stats: dict[str, float]) -> dict[str, float]:
    """An op's stats as the row's `time_stats.<op>.<stat>` columns."""
    return {f"time_stats.{op}.{k}": v for k, v in stats.items()}


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """The rows (the first one's keys are the header), creating the folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
