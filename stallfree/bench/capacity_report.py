"""The capacity result file, and the trial cache the searches of one system share.

`stallfree bench capacity` (real servers, `capacity_run.py`) and `stallfree simulate
capacity` (`stallfree.sim.capacity`) write the same document: the workload and the
search settings, then one entry per system with its searches, and a summary row
per (system, SLO). With a single result, its capacity and criterion are also at
the top (`headline`).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from .capacity import Criterion, Metrics, SearchConfig, SearchResult, Trial
from .workload import WorkloadConfig

# Per-request lists of a report: a trial keeps only the summary numbers.
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "errors", "send_times",
               "token_times", "success")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """A report without its per-request lists."""
    return {k: v for k, v in report.items() if k not in DETAIL_KEYS}


def cached_trials(run: Callable[[float], dict[str, Any]]) -> Callable[[float], Metrics]:
    """`run(rate)` once per rate, its summary kept: the searches of several SLOs share trials."""
    cache: dict[float, Metrics] = {}

    def trial(rate: float) -> Metrics:
        if rate not in cache:
            cache[rate] = summary(run(rate))
        return cache[rate]

    return trial


def trial_line(label: str, t: Trial) -> str:
    """One trial's progress line."""
    m = t.metrics
    tbt = "n/a" if t.tbt_s is None else f"{t.tbt_s * 1e3:.1f} ms"
    delay = "n/a" if t.sched_delay_s is None else f"{t.sched_delay_s:.2f} s"
    if t.sched_delay_source == "prometheus" and t.sched_delay_s is not None:
        delay = "<= " + delay  # the histogram bucket edge above the median
    ttft = m.get("median_ttft_ms")
    return (f"[{label}] {t.rate:.4g} req/s: P99 TBT {tbt}, median TTFT "
            f"{'n/a' if ttft is None else f'{ttft:.0f} ms'}, sched delay {delay} "
            f"({t.sched_delay_source}), {m.get('completed')} ok / {m.get('failed')} failed"
            f" -> {'PASS' if t.passed else 'fail: ' + t.reason}")


def search_slos(label: str, trial: Callable[[float], Metrics], criteria: list[Criterion],
                search: SearchConfig, announce: bool = False) -> list[SearchResult]:
    """One search per criterion (SLO), printing each trial and each capacity found."""
    results = []
    for criterion in criteria:
        if announce:
            print(f"[{label}] searching: {criterion.describe()['text']}", flush=True)
        res = search.search(trial, criterion,
                            on_trial=lambda t: print(trial_line(label, t), flush=True))
        print(f"[{label}] capacity {res.capacity_qps:.4g} req/s at P99 TBT <= "
              f"{criterion.tbt_slo_s * 1e3:g} ms {res.note}", flush=True)
        results.append(res)
    return results


def new_document(workload: WorkloadConfig, search: dict[str, Any], tbt_slos: list[float],
                 **about: Any) -> dict[str, Any]:
    """An empty result file: `about` says what was measured (machine or simulation)."""
    return {"kind": "capacity", "date": time.strftime("%Y%m%d-%H%M%S"), **about,
            "workload": dataclasses.asdict(workload) | {"request_rate": None},
            "search": search, "tbt_slos_s": tbt_slos, "systems": [], "summary": []}


def add_system(doc: dict[str, Any], entry: dict[str, Any]) -> None:
    """A system's entry (its `results` as `SearchResult.to_dict`) and its summary rows."""
    doc["systems"].append(entry)
    for res in entry["results"]:
        doc["summary"].append({"label": entry["label"],
                               "tbt_slo_s": res["criterion"]["tbt_slo_s"],
                               "capacity_qps": res["capacity_qps"],
                               "sched_delay_source": sources(res),
                               "converged": res["converged"], "note": res["note"]})


def headline(doc: dict[str, Any]) -> dict[str, Any]:
    """The document as saved: with one result, its capacity and criterion also at the top."""
    if len(doc["summary"]) != 1:
        return doc
    first = next(s for s in doc["systems"] if s["results"])["results"][0]
    return doc | {"capacity_qps": doc["summary"][0]["capacity_qps"],
                  "criterion": first["criterion"]}


def sources(res: dict[str, Any]) -> list[str]:
    """Which scheduling-delay source(s) the trials of a search used."""
    return sorted({t["sched_delay_source"] for t in res["trials"] if t["sched_delay_source"]})
