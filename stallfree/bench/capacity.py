"""Capacity: the highest request rate whose P99 TBT meets an SLO with bounded queueing.

The search knows nothing about servers: it calls `trial(rate) -> metrics`
(a report dict as `runner.run_benchmark` makes, or any dict with the same
keys), so a simulator can drive it unchanged.

Criterion (the Sarathi-Serve paper's, the same for every system measured):
a rate passes when every request succeeded, the P99 of all TBT gaps is
<= the SLO, and the median scheduling delay is <= 2 s. Scheduling delay is
read from the first available of (`sched_delay_source = "auto"`):

1. `response`: per-request delays the server reported (median of them);
2. `prometheus`: the server's queue-time histogram over the trial; the test
   "median <= limit" is "share of requests queued <= limit >= 1/2", exact at
   a bucket edge (both stallfree and vLLM have one at 2.0 s);
3. `ttft`: for servers that report nothing (llama.cpp): median TTFT minus the
   median TTFT at a very low rate (the prefill time without queueing), which
   is queueing plus any prefill slowdown under load. The result says which.

Search: a doubling bracket from `start_rate` (up while passing, down while
failing), then bisection until hi <= lo * (1 + precision). The capacity is
`lo`, the highest rate that passed; the true threshold lies in [lo, hi)
if pass/fail is monotonic in the rate (it is noisy near the threshold).

A system whose scheduler targets the SLO under test (a token budget of `slo`:
sarathi with `tbt_slo` = that SLO) cannot share trials across SLOs: it is searched
once per SLO (`SearchConfig.split`), by the same criterion as every other system.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config import option

SCHED_SOURCES = ("auto", "response", "prometheus", "ttft")
Metrics = dict[str, Any]
# A token budget that is the TBT SLO under test (`--token-budget slo`, `--system sarathi:slo`).
SLO_BUDGET = "slo"
Budget = int | str  # a token count, or SLO_BUDGET


def parse_budget(text: str) -> Budget:
    """'512' -> 512; 'slo' -> SLO_BUDGET (sarathi with the SLO under test as its tbt_slo)."""
    if text.strip().lower() == SLO_BUDGET:
        return SLO_BUDGET
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"a token budget is an integer or {SLO_BUDGET!r}, got {text!r}") \
            from None


def check_slo_budget(policy: str, budget: Budget | None) -> None:
    """A budget of `slo` is sarathi's alone (the only policy with a TBT SLO target)."""
    if budget == SLO_BUDGET and policy != "sarathi":
        raise ValueError(f"a token budget of {SLO_BUDGET!r} needs the sarathi policy, "
                         f"not {policy!r}")


@dataclass
class Verdict:
    passed: bool
    reason: str
    tbt_s: float | None  # the criterion's TBT percentile
    sched_delay_s: float | None  # median (or estimate, or TTFT excess)
    sched_delay_source: str | None


@dataclass
class Criterion:
    tbt_slo_s: float
    tbt_percentile: float = 99.0
    max_sched_delay_s: float = 2.0
    sched_delay_source: str = "auto"
    require_all_succeed: bool = True
    # For the ttft source: median TTFT at a very low rate, or a function that measures it
    # (called at most once, only if a trial needs it).
    baseline_ttft_s: float | None = None
    baseline: Callable[[], float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.sched_delay_source not in SCHED_SOURCES:
            raise ValueError(f"sched_delay_source must be one of {', '.join(SCHED_SOURCES)}")
        if not self.tbt_slo_s > 0:
            raise ValueError(f"tbt_slo_s must be > 0, got {self.tbt_slo_s}")

    def _tbt(self, m: Metrics) -> float | None:
        p = self.tbt_percentile
        key = f"p{int(p) if int(p) == p else p}_tbt_ms"
        return None if m.get(key) is None else m[key] / 1000.0

    def _sched(self, m: Metrics) -> tuple[bool | None, float | None, str | None]:
        """(meets the limit, value in s, source) by the configured source."""
        limit = self.max_sched_delay_s
        src = self.sched_delay_source
        if src in ("auto", "response") and m.get("median_sched_delay_ms") is not None:
            value = m["median_sched_delay_ms"] / 1000.0
            return value <= limit, value, "response"
        queue = m.get("server_queue_time") or {}
        if src in ("auto", "prometheus") and queue.get("count"):
            frac = _fraction_le(queue, limit)
            # The bucket edge above the median: a bound, consistent with the exact test.
            value = queue.get("median_upper_s", queue.get("median_s"))
            return frac >= 0.5, value, "prometheus"
        if src in ("auto", "ttft") and m.get("median_ttft_ms") is not None:
            if self.baseline_ttft_s is None:
                if self.baseline is None:
                    raise ValueError("the ttft scheduling-delay source needs baseline_ttft_s "
                                     "(median TTFT at a very low rate) or a baseline function")
                self.baseline_ttft_s = float(self.baseline())
            value = m["median_ttft_ms"] / 1000.0 - self.baseline_ttft_s
            return value <= limit, value, "ttft"
        return None, None, None

    def evaluate(self, m: Metrics) -> Verdict:
        reasons = []
        if self.require_all_succeed and m.get("failed"):
            reasons.append(f"{m['failed']} requests failed")
        tbt = self._tbt(m)
        if tbt is None:
            reasons.append("no TBT measured")
        elif tbt > self.tbt_slo_s:
            reasons.append(f"P{self.tbt_percentile:g} TBT {tbt * 1e3:.1f} ms > "
                           f"{self.tbt_slo_s * 1e3:.1f} ms")
        # No request completed: nothing to measure (and no reason to measure a TTFT baseline).
        ok, delay, source = self._sched(m) if m.get("completed", 1) else (False, None, None)
        if ok is None:
            reasons.append(f"no scheduling delay available ({self.sched_delay_source})")
        elif not ok and source is not None:
            shown = "n/a" if delay is None else f"{delay:.2f} s"
            reasons.append(f"median scheduling delay ({source}) {shown} > "
                           f"{self.max_sched_delay_s:g} s")
        return Verdict(not reasons, "; ".join(reasons) or "ok", tbt, delay, source)

    def describe(self) -> dict[str, Any]:
        return {"tbt_slo_s": self.tbt_slo_s, "tbt_percentile": self.tbt_percentile,
                "max_median_sched_delay_s": self.max_sched_delay_s,
                "sched_delay_source": self.sched_delay_source,
                "require_all_succeed": self.require_all_succeed,
                "baseline_ttft_s": self.baseline_ttft_s,
                "text": f"P{self.tbt_percentile:g} TBT <= {self.tbt_slo_s * 1e3:g} ms and "
                        f"median scheduling delay <= {self.max_sched_delay_s:g} s"
                        + (" and no failed request" if self.require_all_succeed else "")}


@dataclass
class SearchConfig:
    """One capacity search per TBT SLO, all with these settings (bench's and the simulator's)."""

    tbt_slos: list[float] = field(default_factory=list)  # seconds; the searches share trials
    tbt_percentile: float = option(Criterion.tbt_percentile, "the TBT percentile held to the SLO")
    max_sched_delay: float = option(Criterion.max_sched_delay_s,
                                    "median scheduling delay limit, in seconds",
                                    metavar="SECONDS")
    start_rate: float = option(1.0, "first rate tried, in requests per second")
    precision: float = option(0.025, "stop when the failing rate <= passing rate * (1 + this)")
    min_rate: float = option(0.01, "lowest rate tried")
    max_rate: float = option(math.inf, "highest rate tried")
    max_trials: int = option(20, "rates tried per SLO at most")

    def criteria(self, source: str = "auto", require_all_succeed: bool = True,
                 baseline: Callable[[], float] | None = None) -> list[Criterion]:
        """The criterion of each SLO."""
        return [Criterion(slo, self.tbt_percentile, self.max_sched_delay, source,
                          require_all_succeed, baseline=baseline) for slo in self.tbt_slos]

    def search(self, trial: Callable[[float], Metrics], criterion: Criterion,
               on_trial: Callable[[Trial], None] | None = None) -> SearchResult:
        return search_capacity(trial, criterion, self.start_rate, self.precision, self.min_rate,
                               self.max_rate, self.max_trials, on_trial)

    def split(self, per_slo: bool) -> list[tuple[float | None, SearchConfig]]:
        """The searches of one system, each as (the SLO its scheduler targets, the search):
        one covering every SLO with shared trials (target None) or, when `per_slo` (the
        system's scheduler targets the SLO under test), one per SLO."""
        if not per_slo:
            return [(None, self)]
        return [(slo, replace(self, tbt_slos=[slo])) for slo in self.tbt_slos]

    def describe(self) -> dict[str, Any]:
        return {"start_rate": self.start_rate, "precision": self.precision,
                "min_rate": self.min_rate, "max_rate": self.max_rate,
                "max_trials": self.max_trials}


def _fraction_le(queue: dict[str, Any], limit: float) -> float:
    """Share queued <= the largest bucket edge <= limit (a lower bound between edges)."""
    if limit == 2.0 and queue.get("frac_le_2s") is not None:
        return queue["frac_le_2s"]
    edges = [(le, n) for le, n in queue.get("buckets", []) if le <= limit]
    return max(edges)[1] / queue["count"] if edges else 0.0


@dataclass
class Trial:
    rate: float
    passed: bool
    reason: str
    tbt_s: float | None
    sched_delay_s: float | None
    sched_delay_source: str | None
    metrics: Metrics = field(repr=False)


@dataclass
class SearchResult:
    capacity_qps: float  # highest passing rate; 0 if none passed
    upper_qps: float | None  # lowest failing rate above it (None: never failed)
    precision: float
    converged: bool
    criterion: dict[str, Any]
    trials: list[Trial]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        # Trials last: the headline fields come first in the file.
        out["trials"] = out.pop("trials")
        return out


def search_capacity(trial: Callable[[float], Metrics], criterion: Criterion,
                    start_rate: float = 1.0, precision: float = 0.025,
                    min_rate: float = 0.01, max_rate: float = math.inf,
                    max_trials: int = 30,
                    on_trial: Callable[[Trial], None] | None = None) -> SearchResult:
    """Doubling bracket, then bisection to a relative `precision`; see the module doc."""
    if not start_rate > 0 or not precision > 0:
        raise ValueError("start_rate and precision must be > 0")
    trials: list[Trial] = []
    tried: dict[float, bool] = {}

    def passes(rate: float) -> bool:
        if rate not in tried:
            m = trial(rate)
            v = criterion.evaluate(m)
            t = Trial(rate, v.passed, v.reason, v.tbt_s, v.sched_delay_s,
                      v.sched_delay_source, m)
            trials.append(t)
            tried[rate] = v.passed
            if on_trial is not None:
                on_trial(t)
        return tried[rate]

    lo: float | None = None
    hi: float | None = None
    note = ""
    rate = min(start_rate, max_rate)
    if passes(rate):
        lo = rate
        while hi is None and len(trials) < max_trials:
            if rate >= max_rate:
                note = f"passed at max_rate {max_rate:g}: the capacity is at least that"
                break
            rate = min(rate * 2, max_rate)
            if passes(rate):
                lo = rate
            else:
                hi = rate
    else:
        hi = rate
        while lo is None and len(trials) < max_trials:
            rate /= 2
            if rate < min_rate:
                note = f"failed at every rate down to {rate * 2:g} req/s"
                break
            if passes(rate):
                lo = rate
            else:
                hi = rate
    while lo is not None and hi is not None and hi > lo * (1 + precision) \
            and len(trials) < max_trials:
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    converged = lo is not None and hi is not None and hi <= lo * (1 + precision)
    if not converged and not note:
        note = f"stopped after max_trials={max_trials}"
    return SearchResult(lo or 0.0, hi, precision, converged, criterion.describe(), trials, note)
