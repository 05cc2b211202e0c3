"""One benchmark run against a server: workload -> client -> report (+ server queue time)."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from . import prom
from .client import ClientConfig, run
from .metrics import PERCENTILES, SLOs, compute_report
from .workload import RequestSpec, WorkloadConfig, build_workload, describe


@dataclass
class BenchConfig:
    workload: WorkloadConfig
    client: ClientConfig
    slos: SLOs | None = None
    tbt_slo_ms: float | None = None  # also counts the TBT gaps over it
    percentiles: tuple[float, ...] = PERCENTILES
    scrape_metrics: bool = True  # the server's queue-time histogram, if it has /metrics
    detail: bool = True  # per-request lists and token times in the report
    label: str | None = None


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # as vLLM writes it; JSON has no Infinity


def run_benchmark(cfg: BenchConfig, token_salt: int = 0) -> dict[str, Any]:
    """Runs the workload once and returns the report with its configuration."""
    c = cfg.client
    specs = build_workload(cfg.workload, token_salt)
    before = prom.scrape_queue_time(c.base_url, c.api_key) if cfg.scrape_metrics else None
    result = run(specs, c)
    report = report_header(cfg, specs, result.start_unix)
    report |= compute_report(result, cfg.slos, cfg.percentiles, cfg.detail, cfg.tbt_slo_ms)
    if before is not None:
        # Failed requests may never reach the engine (e.g. a 404): wait for the completed only.
        after = _settled_queue_time(c, before, report["completed"])
        if after is not None:
            hist = after.minus(before)
            report["server_queue_time"] = hist.summary() | {
                "buckets": [[le, n] for le, n in sorted(hist.buckets.items())
                            if not math.isinf(le)]}
    return report


def report_header(cfg: BenchConfig, specs: list[RequestSpec], start_unix: float,
                  backend: str = "openai") -> dict[str, Any]:
    """The run's configuration, first in every report (the simulator writes the same)."""
    w, c = cfg.workload, cfg.client
    return {
        "date": datetime.fromtimestamp(start_unix, timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": backend, "label": cfg.label, "model_id": c.model, "base_url": c.base_url,
        "endpoint": c.endpoint, "dataset_name": w.dataset if not w.dataset_path else w.dataset_path,
        "num_prompts": w.num_prompts, "request_rate": _rate_json(w.request_rate),
        "burstiness": w.burstiness, "max_concurrency": c.max_concurrency, "seed": w.seed,
        "length_scale": w.length_scale, "max_model_len": w.max_model_len,
        "ignore_eos": c.ignore_eos, "max_duration": c.max_duration, "workload": describe(specs),
    }


def _settled_queue_time(c: ClientConfig, before: prom.Histogram,
                        expected: int, wait: float = 3.0) -> prom.Histogram | None:
    """Scrapes until the server has observed the run's requests (or `wait` s pass)."""
    deadline = time.monotonic() + wait
    while True:
        after = prom.scrape_queue_time(c.base_url, c.api_key)
        if after is None or after.count - before.count >= expected or \
                time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def with_rate(cfg: BenchConfig, rate: float, **client_changes: Any) -> BenchConfig:
    """A copy at another request rate (and client settings)."""
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, request_rate=rate),
                               client=dataclasses.replace(cfg.client, **client_changes))


def _clean(obj: Any) -> Any:
    """NaN/inf -> None, so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def save_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(_clean(obj), f, indent=1, allow_nan=False)
        f.write("\n")
