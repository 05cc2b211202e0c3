"""Prometheus metrics, named as vLLM's (`vllm:` -> `stallfree:`) so dashboards carry over.

Each `ServerMetrics` owns a private registry, so several servers (or tests) can
live in one process. Observations come from the engine thread;
prometheus-client is thread-safe.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import EngineInfo, EngineStats, IterationRecord, RequestOutput

if TYPE_CHECKING:
    from ..structured import GrammarCompileService

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"stallfree:{name}", doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"stallfree:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"stallfree:{name}", doc, labels, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Time from arrival to the first token, in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between consecutive tokens of a sequence, in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Time from arrival to the last token, in seconds.", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time from arrival to first being scheduled, in seconds.",
                                    _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Tokens (prefill + decode) computed per iteration.",
                                          _ITERATION_TOKEN_BUCKETS)
        # Under --tbt-slo: the budget the SLO gave each iteration, and its predicted and
        # measured seconds (how well the online cost model tracks this machine).
        self.iteration_budget = histogram(
            "iteration_token_budget", "Token budget the TBT SLO allowed each iteration.",
            _ITERATION_TOKEN_BUCKETS)
        self.iteration_predicted = histogram(
            "iteration_predicted_seconds", "Predicted time of each iteration under the TBT SLO, "
            "in seconds.", _ITL_BUCKETS)
        self.iteration_measured = histogram(
            "iteration_measured_seconds", "Measured time of each iteration under the TBT SLO, "
            "in seconds.", _ITL_BUCKETS)
        self.slo_margin = gauge(
            "tbt_slo_margin", "Share of the TBT SLO an iteration's predicted time may fill now "
            "(learned from the iterations' overruns of their prediction unless set).")
        self.running = gauge("num_requests_running", "Sequences running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "KV cache blocks free.")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "KV cache blocks in all.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled (once per prompt).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (by recompute).")
        # vLLM v1's prefix cache counters: tokens needed at admissions, and found cached.
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._success = Counter("stallfree:request_success",
                                "Sequences that finished, by finish reason.",
                                labels + ["finished_reason"], registry=registry)
        self.aborted = counter("request_aborted", "Requests aborted (e.g. client disconnects).")
        self.worker_restarts = counter("worker_restarts",
                                       "Times failed workers were restarted (requests recomputed).")
        self._prefix_seen = (0, 0)  # the engine's prefix cache queries and hits, counted
        self._engine_info = Info("stallfree:engine", "How the engine runs: device, dtype (and "
                                 "why auto chose it), compute threads, huge pages, the matmul "
                                 "weights' types, and the kernel table (op=implementation, "
                                 "comma-separated).",
                                 registry=registry)

    def watch_grammars(self, grammars: GrammarCompileService) -> None:
        """Reports the compile service's cache and compiles at every scrape."""
        self.registry.register(_GrammarCollector(grammars, self.model_name))

    def observe_stats(self, stats: EngineStats) -> None:
        """The engine's load gauges, and what its cumulative prefix-cache counts added."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_free_blocks.set(stats.num_free_blocks)
        self.kv_total_blocks.set(stats.num_total_blocks)
        if stats.tbt_slo_margin is not None:
            self.slo_margin.set(stats.tbt_slo_margin)
        # The engine counts since its cache was made (reconfigure restarts them).
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_seen
        if queries < seen_queries or hits < seen_hits:
            seen_queries = seen_hits = 0
        self.prefix_cache_queries.inc(queries - seen_queries)
        self.prefix_cache_hits.inc(hits - seen_hits)
        self._prefix_seen = (queries, hits)

    def set_engine_info(self, info: EngineInfo) -> None:
        self._engine_info.info({"model_name": self.model_name, "device": info.device,
                                "dtype": info.dtype, "dtype_reason": info.dtype_reason,
                                "threads": str(info.threads), "huge_pages": info.huge_pages,
                                "weights": info.weights, "kv_cache_dtype": info.kv_cache_dtype,
                                "kernels": ",".join(f"{op}={impl}"
                                                    for op, impl, _ in info.kernels)})

    def observe_finished(self, out: RequestOutput) -> None:
        """Latencies of a finished request (engine monotonic times)."""
        ends = []
        for i, seq in enumerate(out.outputs):
            times = seq.token_times
            if times:
                if i == 0:
                    self.ttft.observe(max(0.0, times[0] - out.arrival_time))
                for a, b in zip(times, times[1:]):
                    self.itl.observe(b - a)
                ends.append(times[-1])
            self._success.labels(self.model_name, seq.finish_reason or "unknown").inc()
        if ends:
            self.e2e.observe(max(0.0, max(ends) - out.arrival_time))
        if out.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, out.first_scheduled_time - out.arrival_time))

    def observe_iteration(self, record: IterationRecord) -> None:
        """One completed engine iteration."""
        self.iteration_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens)
        if record.num_preempted:
            self.preemptions.inc(record.num_preempted)
        if record.predicted_time is not None:
            self.iteration_budget.observe(record.token_budget)
            self.iteration_predicted.observe(record.predicted_time)
            self.iteration_measured.observe(record.end - record.start)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GrammarCollector:
    """The grammar cache's size and the compiles by outcome, read when scraped."""

    def __init__(self, grammars: GrammarCompileService, model_name: str) -> None:
        self.grammars = grammars
        self.model_name = model_name

    def describe(self) -> list:
        return []  # not known before a scrape: registered without a describe-time check

    def collect(self) -> list:
        stats = self.grammars.stats()
        model = [self.model_name]
        gauges = [("grammar_cache_bytes", "Memory of the compiled grammars cached, in bytes.",
                   stats.bytes),
                  ("grammar_cache_entries", "Compiled grammars and compile refusals cached.",
                   stats.entries),
                  ("grammar_compiles_running", "Grammar compiles queued or running.",
                   stats.compiling)]
        families: list = []
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"stallfree:{name}", doc, labels=["model_name"])
            family.add_metric(model, value)
            families.append(family)
        compiles = CounterMetricFamily(
            "stallfree:grammar_compiles", "Grammar compiles ended, by outcome (compiled, "
            "refused at a bound, cancelled as their requests left, failed).",
            labels=["model_name", "outcome"])
        for outcome, count in stats.compiles.items():
            compiles.add_metric(model + [outcome], count)
        return families + [compiles]
