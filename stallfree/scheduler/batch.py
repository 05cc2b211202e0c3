"""The iteration a policy is building: its chunks and the token budget they spend."""
from __future__ import annotations

from dataclasses import dataclass, field

from .output import ScheduledChunk


@dataclass
class Batch:
    """The iteration being built: chunks by request id (in order) and the budget spent."""

    token_budget: int
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    num_tokens: int = 0  # budget spent: tokens, plus what prompt logprobs' rows charge
    charges: dict[str, int] = field(default_factory=dict)  # what each chunk spent
    stretched: bool = False  # token_budget was raised for one oversized whole prefill
    num_admitted: int = 0  # requests moved from waiting to running by this iteration

    @property
    def budget_left(self) -> int:
        return self.token_budget - self.num_tokens

    def stretch(self, num_tokens: int) -> None:
        """Raises this iteration's budget so exactly `num_tokens` more fit, and nothing after.

        Only for a whole prefill longer than the budget itself, under a policy
        that cannot chunk it: without this it could never run (vLLM avoids the
        case by requiring max_num_batched_tokens >= max_model_len).
        """
        self.token_budget = max(self.token_budget, self.num_tokens + num_tokens)
        self.stretched = True

    def add(self, chunk: ScheduledChunk, charge: int | None = None) -> None:
        """Adds a chunk that costs `charge` budget tokens (None: its tokens; more for prompt
        logprobs). It spends at most the budget left: the scheduler sizes chunks to their
        charge, but lets a one-token scoring chunk through whatever its logits cost
        (Scheduler._affordable), so that no request can starve."""
        assert chunk.request_id not in self.chunks, f"{chunk.request_id!r} scheduled twice"
        assert chunk.num_tokens <= self.budget_left, "chunk exceeds the token budget"
        charge = min(max(charge or 0, chunk.num_tokens), self.budget_left)
        self.chunks[chunk.request_id] = chunk
        self.charges[chunk.request_id] = charge
        self.num_tokens += charge

    def remove(self, request_id: str) -> None:
        """Drops a chunk (its request was preempted) and gives its budget back."""
        if self.chunks.pop(request_id, None) is not None:
            self.num_tokens -= self.charges.pop(request_id)
