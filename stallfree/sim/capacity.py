"""`stallfree simulate capacity`: the bench capacity search, each trial a simulated run.

The search, its criterion and the result file are the benchmark's own
(`stallfree.bench.capacity*`); the scheduling delay is read from the simulated
requests (the `response` source), as a stallfree server reports it. A setup with a
token budget of `slo` runs sarathi with the SLO under test as its `tbt_slo`, so it is
searched once per SLO (its entries carry `tbt_slo_target_s`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..bench.capacity import SearchConfig
from ..bench.capacity_report import add_system, cached_trials, headline, new_document, search_slos
from ..bench.config import PERCENTILES, SLOs, with_rate
from ..bench.report import save_json
from ..bench.workload import WorkloadConfig
from .run import Deployment, Setup, run_simulated_benchmark, sim_bench_config


def simulate_capacity(workload: WorkloadConfig, deployment: Deployment,
                      setups: list[Setup], search: SearchConfig,
                      slos: SLOs | None = None, percentiles: tuple[float, ...] = PERCENTILES,
                      max_duration: float | None = None,
                      result_file: str | None = None) -> dict[str, Any]:
    """Searches each setup (one targeting the SLO under test once per SLO, the others over
    all SLOs with shared trials); returns the result document, also saved to `result_file`
    after each search."""
    cost = deployment.cost_model()
    doc = new_document(workload, search.describe() | {"max_duration_per_trial": max_duration},
                       search.tbt_slos, simulated=True, deployment=deployment.describe(),
                       cost_model=cost.describe())
    for setup in setups:
        base = sim_bench_config(workload, deployment, setup.label, slos, None, percentiles,
                                False, max_duration)
        for target, slo_search in search.split(setup.targets_slo):
            sched = setup.at_slo(target)
            trial = cached_trials(lambda rate, base=base, sched=sched: run_simulated_benchmark(
                with_rate(base, rate), sched, deployment, cost))
            results = search_slos(setup.label, trial, slo_search.criteria("response"),
                                  slo_search)
            add_system(doc, {"label": setup.label, "tbt_slo_target_s": target,
                             "command": None, "base_url": deployment.url,
                             "scheduler": dataclasses.asdict(sched), "baseline": None,
                             "results": [r.to_dict() for r in results]})
            if result_file:
                save_json(result_file, headline(doc))
    return doc
