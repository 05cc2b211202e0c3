"""What one benchmark run records: per-request token times, and the run around them.

Both the HTTP client (`client.py`) and the simulator (`stallfree.sim`) fill these
records, and the report (`report.py`) reads them; this module imports no HTTP code,
so the simulator runs without it. Times are seconds after the start of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    expected_output_len: int
    scheduled_time: float  # intended arrival (s after start)
    send_time: float | None = None  # actually sent (s after start); None if never sent
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of them
    output_len: int = 0
    success: bool = False
    error: str | None = None
    token_count_exact: bool = True
    scheduling_delay: float | None = None  # seconds, when the server reports it
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # prompt tokens the server had in its prefix cache
    turn: int = 0  # of its conversation (0: the first, or a single request)

    @property
    def token_times(self) -> list[float]:
        """Arrival time of every output token (tokens of one chunk share its time)."""
        return [t for t, n in zip(self.chunk_times, self.chunk_tokens) for _ in range(n)]

    @property
    def ttft(self) -> float | None:
        if self.send_time is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def latency(self) -> float | None:
        if self.send_time is None or not self.chunk_times:
            return None
        return self.chunk_times[-1] - self.send_time

    @property
    def itl(self) -> list[float]:
        """vLLM's ITL: gaps between consecutive chunks."""
        return [b - a for a, b in pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); requests of one token have none."""
        if self.output_len < 2 or self.latency is None or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def tbt(self) -> list[float]:
        """Every gap between consecutive output tokens (the first token excluded)."""
        return [b - a for a, b in pairwise(self.token_times)]


@dataclass
class RunResult:
    results: list[RequestResult]
    duration: float  # first send to last response (s)
    start_unix: float  # wall clock at the start, for the report
