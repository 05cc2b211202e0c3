"""What the engine hands back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probabilities (under the model's raw distribution) at one output step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, best first


@dataclass
class CompletionOutput:
    """One generated sequence (a request with n > 1 has several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    token_times: list[float] = field(default_factory=list)  # when each token was produced
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token when requested


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    first_scheduled_time: float | None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    # The first sequence's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token of the first sequence."""
        times = self.outputs[0].token_times
        return times[0] - self.arrival_time if times else None

    @property
    def tbt(self) -> list[float]:
        """Gaps between consecutive tokens of the first sequence, in seconds."""
        times = self.outputs[0].token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class StepOutput:
    """What one engine step produced for one sequence (streaming granularity)."""

    request_id: str  # the caller's id
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per new token when requested
