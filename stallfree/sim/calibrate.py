"""Calibration against the Sarathi-Serve paper's measured Yi-34B (TP2, A100) iterations.

The measurements (stallfree/data/measurements/sarathi_serve_osdi24, provenance
in SOURCES.md there) are whole iterations of the paper's serving system:
GPU operators plus its CPU work. `points()` turns each into the batch(es) it
ran, `table()` compares them with the cost model, and `fit_overhead()` fits
the per-iteration CPU time the operator profiles miss, as a + b * requests
(weighted least squares on relative error over the Figure 2 points, which
are the cleanest: one batch kind each, one size at a time).

    stallfree simulate calibrate           # prints the table of docs/simulation.md
"""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

from .cost_model import BatchShape, CostModel, ProfiledCostModel
from .hardware import get_gpu, get_model

MEASUREMENTS = (Path(__file__).resolve().parent.parent / "data" / "measurements"
                / "sarathi_serve_osdi24")
DECODE_CONTEXT_FIG2 = 1020  # 1024-token requests at prefill:decode 255 (the paper's runs.sh)
DECODE_CONTEXT_TABLE2 = 1030  # 1024 prompt + up to 16 outputs


@dataclass(frozen=True)
class Point:
    label: str
    batches: tuple[BatchShape, ...]  # iterations whose times add up to the measurement
    measured_s: float
    fit: bool = True  # used by fit_overhead
    note: str = ""


def _rows(name: str) -> list[dict[str, str]]:
    with open(MEASUREMENTS / name, newline="") as f:
        return list(csv.DictReader(f))


def chunked_prefill(length: int, chunk: int) -> tuple[BatchShape, ...]:
    """A lone prompt prefilled in chunks of `chunk` tokens (the last one samples)."""
    out, done = [], 0
    while done < length:
        n = min(chunk, length - done)
        out.append(BatchShape.prefill(n, done, samples=done + n == length))
        done += n
    return tuple(out)


def points() -> list[Point]:
    pts = []
    for r in _rows("figure2_prefill_batch_time_yi34b_tp2_a100.csv"):
        n = int(float(r["batch_num_prefill_tokens"]))
        warmup = not r["inter_batch_delay"]  # the first batch of its run: a warm-up outlier
        pts.append(Point(f"fig2 prefill {n}", (BatchShape.prefill(n),),
                         float(r["batch_execution_time"]), fit=not warmup and n <= 4096,
                         note="first batch of its run (warm-up)" if warmup else ""))
    for r in _rows("figure2_decode_batch_time_yi34b_tp2_a100.csv"):
        b = int(float(r["batch_size"]))
        pts.append(Point(f"fig2 decode x{b}", (BatchShape.decode(b, DECODE_CONTEXT_FIG2),),
                         float(r["batch_execution_time"])))
    for r in _rows("figure9_chunking_overhead_yi34b_tp2_a100.csv"):
        length, chunk = int(r["prefill_length"]), int(r["chunk_size"])
        label = "unchunked (16384)" if chunk >= 16384 else f"chunks of {chunk}"
        pts.append(Point(f"fig9 prefill {length}, {label}", chunked_prefill(length, chunk),
                         float(r["prefill_execution_time"]) / 1e3, fit=False))
    for r in _rows("table2_hybrid_batch_yi34b_tp2_a100.csv"):
        p, d = int(float(r["batch_num_prefill_tokens"])), int(float(r["batch_num_decode_tokens"]))
        shape = BatchShape(((p, 0),) if p else (), d, d * DECODE_CONTEXT_TABLE2, d + bool(p))
        kind = "hybrid" if p and d else "prefill" if p else "decode"
        pts.append(Point(f"table2 {kind} {p}+{d}", (shape,),
                         float(r["batch_execution_time"]) / 1e3, fit=False))
    return pts


def predict(cost: CostModel, point: Point) -> float:
    return sum(cost.iteration(b).total(cost.pp) for b in point.batches)


def base_model() -> ProfiledCostModel:
    return ProfiledCostModel(get_model("yi-34b"), get_gpu("a100"), tp=2)


@functools.lru_cache(maxsize=1)
def fit_overhead() -> tuple[float, float]:
    """(a, b) seconds: CPU time per iteration and per request missing from the profiles."""
    cost = base_model()
    xs, ys, ws = [], [], []
    for p in points():
        if p.fit and p.label.startswith("fig2"):
            (b,) = p.batches
            xs.append(b.num_seqs)
            ys.append(p.measured_s - predict(cost, p))
            ws.append(1.0 / p.measured_s ** 2)
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    var = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / var
    return my - slope * mx, slope


def table() -> str:
    """Markdown: measured vs predicted per point, from profiles alone and calibrated."""
    plain = base_model()
    a, b = fit_overhead()
    calibrated = ProfiledCostModel(get_model("yi-34b"), get_gpu("a100"), tp=2, extra_cpu=(a, b))
    lines = [(f"Calibrated extra CPU time per iteration: {a * 1e3:.1f} ms + "
              f"{b * 1e3:.3f} ms x requests in the batch."), "",
             "| point | measured (ms) | profiles (ms) | error | calibrated (ms) | error | note |",
             "|---|---:|---:|---:|---:|---:|---|"]
    errs: dict[str, list[float]] = {"plain": [], "cal": []}
    for p in points():
        m, x, y = p.measured_s, predict(plain, p), predict(calibrated, p)
        ex, ey = (x - m) / m, (y - m) / m
        if not p.note:
            errs["plain"].append(abs(ex))
            errs["cal"].append(abs(ey))
        note = p.note or ("" if p.fit else "not fitted")
        lines.append(f"| {p.label} | {m * 1e3:.1f} | {x * 1e3:.1f} | {ex:+.1%} | "
                     f"{y * 1e3:.1f} | {ey:+.1%} | {note} |")
    for key, name in (("plain", "profiles"), ("cal", "calibrated")):
        e = sorted(errs[key])
        lines.append(f"\nMean |error| ({name}, warm-up excluded): {sum(e) / len(e):.1%}, "
                     f"max {e[-1]:.1%}.")
    return "\n".join(lines)


DEFAULT_TOLERANCE = 0.15  # relative error a validation accepts
VALIDATION_KEYS = (("median_tbt_ms", "median TBT"), ("p99_tbt_ms", "P99 TBT"),
                   ("median_ttft_ms", "median TTFT"))


def validation_errors(measured: dict, simulated: dict
                      ) -> list[tuple[str, float | None, float | None, float | None]]:
    """Per metric of VALIDATION_KEYS: (name, measured, simulated, the simulation's relative
    error, None where a report lacks the metric or the measured value is 0)."""
    rows = []
    for key, name in VALIDATION_KEYS:
        m, s = measured.get(key), simulated.get(key)
        rows.append((name, m, s, (s - m) / m if m and s is not None else None))
    return rows


def compare(measured: dict, simulated: dict,
            tolerance: float = DEFAULT_TOLERANCE) -> tuple[str, bool]:
    """A measured `bench serve` report against its simulation: the issue's three metrics."""
    lines = ["| metric | measured (ms) | simulated (ms) | error |", "|---|---:|---:|---:|"]
    ok = True
    for name, m, s, err in validation_errors(measured, simulated):
        if err is None:
            lines.append(f"| {name} | {m} | {s} | n/a |")
            ok = False
            continue
        ok &= abs(err) <= tolerance
        lines.append(f"| {name} | {m:.1f} | {s:.1f} | {err:+.1%} |")
    lines.append(f"\nwithin {tolerance:.0%} on all three: {'yes' if ok else 'NO'}")
    return "\n".join(lines), ok

