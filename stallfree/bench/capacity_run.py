"""`stallfree bench capacity`: the capacity search run against real servers, one by one.

For each system: start it (or use its URL), send a few warm-up requests,
then search once per TBT SLO. Trials are cached by rate per system, so the
strict and relaxed searches share every rate they both try (a system whose
command takes the SLO under test, `{tbt_slo}`, is started and searched once per
SLO instead: its entries carry `tbt_slo_target_s`), and the low-rate
TTFT baseline (only for the `ttft` scheduling-delay source) is measured at
most once. The result file is rewritten after each system, so a crash or
an interrupt keeps what was measured.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import shlex
from typing import Any

from .capacity_report import add_system, cached_trials, headline, new_document, search_slos, summary
from .config import CapacityConfig, with_rate
from .report import save_json
from .run import run_benchmark
from .systems import ServerProcess, System


def measure_system(cfg: CapacityConfig, system: System, base_url: str) -> dict[str, Any]:
    """Warm-up, then one search per SLO; returns the system's entry of the result file."""
    base = dataclasses.replace(cfg.bench, label=system.label, detail=bool(cfg.trial_detail_dir),
                               client=dataclasses.replace(cfg.bench.client, base_url=base_url))
    quiet = dataclasses.replace(base, detail=False, scrape_metrics=False)
    salts = itertools.count(1)  # a fresh prompt-id stream for every run (no prefix-cache hits)
    if cfg.warmup_prompts > 0:
        warm = dataclasses.replace(quiet, workload=dataclasses.replace(
            quiet.workload, num_prompts=cfg.warmup_prompts))
        run_benchmark(with_rate(warm, math.inf, max_concurrency=1), token_salt=10**6)

    def run_trial(rate: float) -> dict[str, Any]:
        report = run_benchmark(with_rate(base, rate), token_salt=next(salts))
        if cfg.trial_detail_dir:
            os.makedirs(cfg.trial_detail_dir, exist_ok=True)
            save_json(os.path.join(cfg.trial_detail_dir,
                                   f"{system.label}_rate{rate:.4f}.json"), report)
        return report

    baseline_report: dict[str, Any] = {}

    def baseline() -> float:
        if not baseline_report:
            n = min(cfg.baseline_prompts, cfg.bench.workload.num_prompts)
            few = dataclasses.replace(quiet, workload=dataclasses.replace(quiet.workload,
                                                                          num_prompts=n))
            report = summary(run_benchmark(with_rate(few, math.inf, max_concurrency=1),
                                           token_salt=2 * 10**6))
            if report.get("median_ttft_ms") is None:
                raise RuntimeError(f"the low-rate TTFT baseline failed: {report['error_counts']}")
            baseline_report.update(report)
            print(f"[{system.label}] low-rate baseline: median TTFT "
                  f"{baseline_report['median_ttft_ms']:.0f} ms over {n} requests one at a time",
                  flush=True)
        return baseline_report["median_ttft_ms"] / 1000.0

    criteria = cfg.search.criteria(cfg.sched_delay_source, not cfg.allow_failures, baseline)
    results = search_slos(system.label, cached_trials(run_trial), criteria, cfg.search,
                          announce=True)
    return {"label": system.label, "command": system.command, "base_url": base_url,
            "baseline": baseline_report or None, "results": [r.to_dict() for r in results]}


def with_min_rate_floor(cfg: CapacityConfig) -> CapacityConfig:
    """No trial below the rate at which the workload cannot even be sent within max_duration.

    Below N / max_duration the trial would fail for lack of time, not for missing the SLO;
    1.5x leaves a third of the time to drain the queue. With conversations, the rate is
    their arrival rate: N counts conversations, not turns.
    """
    max_duration, workload = cfg.bench.client.max_duration, cfg.bench.workload
    if max_duration is None:
        return cfg
    arrivals = -(-workload.num_prompts // workload.turns)
    floor = 1.5 * arrivals / max_duration
    if cfg.search.min_rate < floor:
        what = "requests" if workload.turns == 1 else "conversations"
        print(f"min rate raised to {floor:.3g} req/s: {arrivals} {what} must arrive "
              f"within 2/3 of --max-duration {max_duration:g} s", flush=True)
    search = dataclasses.replace(cfg.search, min_rate=max(cfg.search.min_rate, floor))
    return dataclasses.replace(cfg, search=search)


def start_and_measure(cfg: CapacityConfig, system: System) -> dict[str, Any]:
    """The system's entry of the result file: started (if it has a command), measured,
    stopped; an error that kept it from being measured is in the entry."""
    server = None
    try:
        if system.command is not None:
            print(f"[{system.label}] starting: {shlex.join(system.command)}", flush=True)
            server = ServerProcess(system, cfg.startup_timeout, cfg.log_dir)
            url = server.base_url
        else:
            url = system.base_url or ""
        entry = measure_system(cfg, system, url)
        if server is not None:
            entry |= {"log": server.log_path, "pid": server.proc.pid}
    except (RuntimeError, TimeoutError, OSError) as err:
        print(f"[{system.label}] error: {err}", flush=True)
        entry = {"label": system.label, "command": system.command, "error": str(err),
                 "results": []}
    finally:
        if server is not None:
            server.stop()
    return entry


def run_capacity(systems: list[System], cfg: CapacityConfig) -> dict[str, Any]:
    """Measures each system in turn (starting and stopping those with a command; one whose
    command takes the SLO under test once per SLO); returns the result document, also saved
    to `cfg.result_file` after each system."""
    cfg = with_min_rate_floor(cfg)
    search = cfg.search.describe() | {"max_duration_per_trial": cfg.bench.client.max_duration,
                                      "warmup_prompts": cfg.warmup_prompts}
    doc = new_document(cfg.bench.workload, search, cfg.search.tbt_slos, cpu_count=os.cpu_count())
    for system in systems:
        for target, slo_search in cfg.search.split(system.targets_slo):
            entry = start_and_measure(dataclasses.replace(cfg, search=slo_search),
                                      system.at_slo(target))
            add_system(doc, {"label": system.label, "tbt_slo_target_s": target} | entry)
            if cfg.result_file:
                save_json(cfg.result_file, headline(doc))
    return doc
