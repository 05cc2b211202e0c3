"""Per-iteration records as JSON lines: what `stallfree serve --iteration-log` writes.

A header line (`{"iteration_log": 1, ...}`: the engine's block size, compute threads and
pipeline depth), then one line per engine iteration (an `IterationRecord` without its
request ids), so a run can be inspected afterwards or its iterations replayed through
the simulator's cost model (`stallfree simulate replay`).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import TextIO

from .outputs import IterationRecord

_SKIPPED = ("request_ids",)  # long and private; the shape of the batch is what matters
_IF_SET = ("token_budget", "predicted_time", "target_time")  # only under a TBT SLO


class IterationLog:
    """Appends records to a file; line-buffered, so a killed server leaves whole lines."""

    def __init__(self, path: str | Path | TextIO) -> None:
        """`path`: a file to (re)create, or a text stream already open for writing."""
        if hasattr(path, "write"):
            self.path, self._file = None, path
        else:
            self.path = Path(path)
            self._file = open(self.path, "w", buffering=1)
        self._lock = threading.Lock()

    def header(self, **settings: object) -> None:
        """The engine's settings a reader needs (written once, before any record)."""
        with self._lock:
            self._file.write(json.dumps({"iteration_log": 1, **settings}) + "\n")

    def write(self, record: IterationRecord) -> None:
        row = {k: v for k, v in dataclasses.asdict(record).items()
               if k not in _SKIPPED and not (k in _IF_SET and v is None)}
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def close_quietly(self) -> None:
        """Closes it, ignoring the error a full disk gives on flushing the last line."""
        try:
            self.close()
        except (OSError, ValueError):
            pass


def read_iteration_log(path: str | Path) -> tuple[dict, list[IterationRecord]]:
    """The header's settings and the records of a log; a malformed line raises ValueError
    naming it."""
    fields = {f.name for f in dataclasses.fields(IterationRecord)}
    settings: dict = {}
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "iteration_log" in row:
                    settings = row
                    continue
                unknown = set(row) - fields
                if unknown:
                    raise ValueError(f"unknown fields {sorted(unknown)}")
                row["prefill_chunks"] = tuple(tuple(c) for c in row.get("prefill_chunks", ()))
                row["decode_contexts"] = tuple(row.get("decode_contexts", ()))
                row["stage_times"] = tuple(tuple(t) for t in row.get("stage_times", ()))
                record = IterationRecord(**row)
                shaped = sum(n for n, _ in record.prefill_chunks) + len(record.decode_contexts)
                if shaped != record.num_prefill_tokens + record.num_decode_tokens:
                    raise ValueError("its chunks do not add up to its token counts")
                records.append(record)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not an iteration record: {err}") from None
    return settings, records
