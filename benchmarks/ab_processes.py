"""What a benchmark that compares two settings in fresh processes needs (engine_ab.py): a
child that prints one JSON line, and the order of the two sides.

A setting that only takes effect as a process starts (torch's huge-page switch, another
revision's code) needs a process per measurement; on a shared machine whose speed swings
within minutes, the two sides alternate and the order flips every round, so that neither
side gets the quiet minutes.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path


def run_child(args: list[str], env: Mapping[str, str], cwd: Path | None = None,
              timeout: float = 900) -> dict:
    """The JSON object a child (`python args...`) printed on its last line of output."""
    proc = subprocess.run([sys.executable, *args], env=dict(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise SystemExit(f"child {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def alternating(rounds: int, first: object, second: object) -> Iterator[tuple[int, object]]:
    """(round, side) for `rounds` rounds of both sides, the order flipping every round."""
    for r in range(rounds):
        for side in (first, second) if r % 2 == 0 else (second, first):
            yield r, side

