"""A request's state as it moves through the engine; plain data, no torch."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """One sequence to generate.

    The catch-up rule: `num_computed_tokens` chases `num_tokens` (prompt plus
    outputs so far). A policy only decides how far each request catches up in
    an iteration. When a request is caught up after an iteration, a token is
    sampled for it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission (None before).
    num_cached_tokens: int | None = None
    # Keys of its full blocks, filled in by the block manager as they are needed.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # False while something the request needs before it can run is still being prepared
    # (its grammar compiling, off the engine thread): the scheduler leaves it aside.
    ready: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def num_prompt_logprob_rows(self, start: int, num_tokens: int) -> int:
        """How many positions of the chunk [start, start + num_tokens) predict a prompt token
        (position p predicts token p + 1) and so need their logits, when prompt logprobs
        were asked for; 0 otherwise."""
        if not self.wants_prompt_logprobs:
            return 0
        return max(0, min(start + num_tokens, self.num_prompt_tokens - 1) - start)

    @property
    def is_prefill(self) -> bool:
        """True until the whole prompt (and any outputs to recompute) is cached."""
        return self.num_tokens_to_compute > 1 or self.num_computed_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None
