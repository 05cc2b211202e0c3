"""What one scheduler iteration hands to the executor: pure data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..attention_plan import split_chunks
from ..outputs import IterationRecord
from ..request import Request


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`, computed this iteration.

    A decode is a chunk of one token; a prefill chunk (or the recompute of a
    preempted request) covers many. `is_prefill` and `samples` are fixed when
    the chunk is made, so they stay true to this iteration even after
    `Scheduler.update` has appended the sampled token to the request.
    """

    request: Request
    start: int  # request.num_computed_tokens before this iteration
    num_tokens: int
    block_table: list[int]
    is_prefill: bool = field(init=False)
    samples: bool = field(init=False)  # a token is sampled after this chunk

    def __post_init__(self) -> None:
        total = self.request.num_tokens
        if self.num_tokens < 1 or self.start < 0 or self.start + self.num_tokens > total:
            raise ValueError(f"chunk [{self.start}, {self.start + self.num_tokens}) lies outside "
                             f"request {self.request.request_id!r} of {total} tokens")
        # Same rule as Request.is_prefill: only a lone last token after a
        # non-empty cache is a decode.
        self.is_prefill = self.start == 0 or total - self.start > 1
        self.samples = self.start + self.num_tokens == total

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt position when its logprobs were asked for, else None."""
        return self.request.sampling_params.prompt_logprobs

    @property
    def prompt_logprob_targets(self) -> list[int]:
        """The prompt tokens this chunk's first positions predict (position p predicts token
        p + 1), whose logprobs the runner reports; empty unless they were asked for."""
        rows = self.request.num_prompt_logprob_rows(self.start, self.num_tokens)
        return self.request.prompt_token_ids[self.start + 1:self.start + 1 + rows]

    @property
    def token_ids(self) -> list[int]:
        """The tokens at positions [start, start + num_tokens)."""
        prompt = self.request.prompt_token_ids
        end = self.start + self.num_tokens
        if end <= len(prompt):
            return prompt[self.start:end]
        # Avoid concatenating the whole sequence for every decode.
        outputs = self.request.output_token_ids
        head = prompt[self.start:] if self.start < len(prompt) else []
        return head + outputs[max(0, self.start - len(prompt)):end - len(prompt)]


@dataclass
class SchedulerOutput:
    """Every chunk of one iteration, in scheduling order, plus what was preempted."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # ids preempted (recompute) this call
    num_batched_tokens: int = field(init=False)
    num_prefill_tokens: int = field(init=False)
    num_decode_tokens: int = field(init=False)
    # Structured outputs: for each constrained request that samples, its row of
    # `token_bitmask` (packed int32 bits, one per vocabulary token: may it come next).
    # Set by the engine after scheduling; opaque to the scheduler.
    token_bitmask: Any = None
    bitmask_rows: dict[str, int] = field(default_factory=dict)
    # Under a TBT SLO (slo_sarathi.py): the token budget this iteration was given, its
    # predicted time and the time it was held to (SLO x margin), in seconds. None under a
    # fixed budget.
    token_budget: int | None = None
    predicted_time: float | None = None
    target_time: float | None = None

    def __post_init__(self) -> None:
        self.num_prefill_tokens = sum(c.num_tokens for c in self.chunks if c.is_prefill)
        self.num_decode_tokens = sum(c.num_tokens for c in self.chunks if not c.is_prefill)
        self.num_batched_tokens = self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def iteration_record(self, start: float) -> IterationRecord:
        """The record of this batch, scheduled at `start` (its end and times come when it
        completes)."""
        prefills, decodes = split_chunks((c.start, c.num_tokens) for c in self.chunks)
        return IterationRecord(start, 0.0, self.num_prefill_tokens, self.num_decode_tokens,
                               len(self.chunks), len(self.preempted),
                               tuple(c.request_id for c in self.chunks),
                               prefill_chunks=prefills, decode_contexts=decodes,
                               num_sampled=sum(c.samples for c in self.chunks),
                               token_budget=self.token_budget,
                               predicted_time=self.predicted_time,
                               target_time=self.target_time)
