"""One benchmark run against a server: workload -> client -> report (+ server queue time)."""
from __future__ import annotations

import math
import time
from typing import Any

from . import prom
from .client import run
from .config import BenchConfig, ClientConfig
from .report import compute_report, report_header
from .workload import build_workload


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
