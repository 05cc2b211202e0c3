"""Settings of benchmark runs: the client's, the SLOs, one run's (`BenchConfig`) and a
capacity run's over several servers (`CapacityConfig`).

No HTTP code here: the simulator builds the same `BenchConfig` for the server it
replaces. Defaults and help sit on the fields (`stallfree.config.option`); the
command line (`stallfree/cli/`) makes its flags from them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config import option
from .capacity import SCHED_SOURCES, SearchConfig
from .records import RequestResult
from .workload import WorkloadConfig

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2el", "tbt")


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = option(None, "model name sent in requests (default: none)")
    endpoint: str = option("/v1/completions", "API path of the requests")
    api_key: str | None = option(None, "sent as 'Authorization: Bearer KEY'")
    # So every request generates its trace output length.
    ignore_eos: bool = option(True, "do not send ignore_eos (servers that refuse it)",
                              flags=("--no-ignore-eos",))
    ban_token_ids: list[int] = field(default_factory=list)  # logit_bias -100 (llama.cpp)
    continuous_usage: bool = option(True, "do not ask for usage in every chunk",
                                    flags=("--no-continuous-usage",))
    temperature: float = 0.0
    request_timeout: float = option(3600.0, "seconds for one request, first byte to last")
    max_duration: float | None = option(
        None, "seconds for a whole run; later requests fail (default: no limit)")
    max_concurrency: int | None = option(
        None, "requests in flight at once (default: unbounded)")
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/v1") and self.endpoint.startswith("/v1/"):
            base = base[:-3]
        return base + self.endpoint


@dataclass(frozen=True)
class SLOs:
    """Per-request service-level objectives in milliseconds (None: not checked)."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None
    tbt: float | None = None  # every gap between tokens of the request

    @classmethod
    def parse(cls, items: Iterable[str]) -> SLOs:
        """From vLLM's `--goodput ttft:500 tpot:100` form (values in ms)."""
        values: dict[str, float] = {}
        for item in items:
            key, sep, value = item.partition(":")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"goodput SLO must be KEY:MS with KEY in {', '.join(SLO_KEYS)}"
                                 f", got {item!r}")
            ms = float(value)
            if not ms > 0:
                raise ValueError(f"goodput SLO {key} must be > 0 ms, got {value}")
            values[key] = ms
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k in SLO_KEYS if (v := getattr(self, k)) is not None}

    def met_by(self, r: RequestResult) -> bool:
        ms = {"ttft": _ms(r.ttft), "tpot": _ms(r.tpot) or 0.0, "e2el": _ms(r.latency),
              "tbt": _ms(max(r.tbt, default=0.0))}
        return all(ms[k] is not None and ms[k] <= limit for k, limit in self.as_dict().items())


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


@dataclass
class BenchConfig:
    workload: WorkloadConfig
    client: ClientConfig
    slos: SLOs | None = None
    tbt_slo_ms: float | None = None  # also counts the TBT gaps over it
    percentiles: tuple[float, ...] = PERCENTILES
    scrape_metrics: bool = option(
        True, "do not read the server's queue-time histogram from /metrics",
        flags=("--no-scrape-metrics",))
    detail: bool = option(True, "leave per-request lists and token times out of the JSON",
                          flags=("--no-detail",))
    label: str | None = option(None, "the run's name in its report")


def with_rate(cfg: BenchConfig, rate: float, **client_changes: Any) -> BenchConfig:
    """A copy at another request rate (and client settings)."""
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, request_rate=rate),
                               client=dataclasses.replace(cfg.client, **client_changes))


@dataclass
class CapacityConfig:
    """A capacity run over real servers: each system measured with `bench` at `search`'s rates."""

    bench: BenchConfig  # its base_url and label are each system's
    search: SearchConfig = field(default_factory=SearchConfig)
    sched_delay_source: str = option("auto", "where the scheduling delay is read from",
                                     choices=SCHED_SOURCES)
    baseline_prompts: int = option(
        10, "requests (one at a time) for the low-rate TTFT of the ttft source")
    allow_failures: bool = option(False, "a trial with failed requests may still pass")
    warmup_prompts: int = option(2, "requests sent one at a time before a system's searches")
    trial_detail_dir: str | None = option(
        None, "also save every trial's full report here (for TBT CDF plots)")
    startup_timeout: float = option(600.0, "seconds for a started server to answer")
    log_dir: str | None = option(None, "server logs (default: a temp dir)")
    result_file: str | None = None
