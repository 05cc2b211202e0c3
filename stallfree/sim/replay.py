"""`stallfree simulate replay`: a real run's iterations through the cost model.

The engine's iteration log (`stallfree serve --iteration-log`) holds every batch's
shape and its measured CPU time. Predicting each batch with the cost model (host
factor 1, so in CPU seconds) separates the model's error from the scheduling
that follows from it, and from the time neighbours took from the core: the
log's wall over CPU time is that factor for the run.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from ..iteration_log import read_iteration_log
from ..outputs import IterationRecord
from .cost_model import BatchShape, CostModel
from .run import Deployment

# Decode-only batches by request count: small batches are launch-bound, large ones
# attention-bound, so the model's error differs between them.
DECODE_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 32), (33, 64), (65, 1 << 30))


def _row(label: str, pairs: list[tuple[float, float]]) -> dict[str, Any]:
    measured, predicted = sum(m for m, _ in pairs), sum(p for _, p in pairs)
    ratios = [p / m - 1 for m, p in pairs if m > 0]
    return {"batches": label, "iterations": len(pairs), "measured_cpu_s": measured,
            "predicted_s": predicted,
            "error": predicted / measured - 1 if measured > 0 else None,
            "median_iteration_error": statistics.median(ratios) if ratios else None}


def replay(records: list[IterationRecord], cost: CostModel) -> dict[str, Any]:
    """Measured vs predicted CPU seconds, in total and by kind of batch."""
    kinds: dict[str, list[tuple[float, float]]] = {"decode-only": [], "with prefill": []}
    buckets: dict[tuple[int, int], list[tuple[float, float]]] = {b: [] for b in DECODE_BUCKETS}
    wall = cpu = 0.0
    for r in records:
        if not r.prefill_chunks and not r.decode_contexts:
            continue  # nothing computed (the engine logs no such batch)
        shape = BatchShape.of(r.prefill_chunks, r.decode_contexts, r.num_sampled)
        pair = (r.cpu_time, cost.iteration(shape).total(cost.pp))
        wall, cpu = wall + (r.end - r.start), cpu + r.cpu_time
        if r.prefill_chunks:
            kinds["with prefill"].append(pair)
            continue
        kinds["decode-only"].append(pair)
        n = len(r.decode_contexts)
        buckets[next(b for b in DECODE_BUCKETS if b[0] <= n <= b[1])].append(pair)
    rows = [_row(k, v) for k, v in kinds.items()]
    rows.append(_row("all", kinds["decode-only"] + kinds["with prefill"]))
    rows += [_row(f"decode x{lo}-{hi}" if hi < 1 << 30 else f"decode x{lo}+", v)
             for (lo, hi), v in buckets.items() if v]
    return {"iterations": len(records), "wall_per_cpu": wall / cpu if cpu > 0 else None,
            "rows": rows}


def format_replay(result: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    lines = [f"{result['iterations']} iterations; wall per CPU second in the run: "
             f"{result['wall_per_cpu'] or float('nan'):.2f}",
             f"{'batches':<16}{'iters':>7}{'measured s':>12}{'predicted s':>13}{'error':>9}"
             f"{'median it.':>12}"]
    for r in result["rows"]:
        lines.append(f"{r['batches']:<16}{r['iterations']:>7}{r['measured_cpu_s']:>12.2f}"
                     f"{r['predicted_s']:>13.2f}{pct(r['error']):>9}"
                     f"{pct(r['median_iteration_error']):>12}")
    return "\n".join(lines)


def replay_log(path: str, deployment: Deployment) -> tuple[dict[str, Any], str | None]:
    """A served run's iteration log through the deployment's cost model, and a warning when
    the log's CPU times do not compare (more than one compute thread, or a pipeline)."""
    settings, records = read_iteration_log(path)
    warning = None
    if settings.get("threads", 1) > 1 or settings.get("pipeline_depth", 1) > 1:
        warning = (f"the server ran with {settings.get('threads')} compute threads and "
                   f"pipeline depth {settings.get('pipeline_depth')}; its cpu_time counts the "
                   "engine thread's own work only, so the comparison holds for one thread "
                   "in-process")
    # The log's times are CPU seconds: predict them without the host's slowdown.
    deployment = dataclasses.replace(deployment, cpu_slowdown=1.0,
                                     block_size=settings.get("block_size",
                                                             deployment.block_size))
    return replay(records, deployment.cost_model()), warning
