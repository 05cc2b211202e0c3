"""Prompt tokens' logprobs, from the forward pass's rows that sampling does not read."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..outputs import PromptLogprobs
from .sampler import rows_logprobs

# Logits rows per LM-head call: a [rows, vocab] float32 buffer (48 MiB at 256 x 49K) instead
# of one as long as the chunk.
ROWS_PER_CALL = 256


class LogitsModel(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class ScoredChunk(Protocol):
    """What is read of a chunk (a ScheduledChunk, or a worker's view of one)."""

    request_id: str
    start: int

    @property
    def prompt_logprobs(self) -> int | None: ...

    @property
    def prompt_logprob_targets(self) -> list[int]: ...


def prompt_logprobs(model: LogitsModel, hidden: torch.Tensor, chunks: Sequence[ScoredChunk],
                    offsets: Sequence[int], report: bool) -> dict[str, PromptLogprobs]:
    """Request id -> the logprobs of the prompt tokens its chunk predicts, for the chunks
    that asked for them. `offsets[i]`: chunk i's first row in `hidden`. Every rank of a
    tensor-parallel group calls this (the logits are gathered across them); only the one
    that `report`s computes the logprobs."""
    result = {}
    for chunk, offset in zip(chunks, offsets):
        if chunk.prompt_logprobs is None:  # the common case, checked first: every step runs this
            continue
        targets = chunk.prompt_logprob_targets
        if not targets:
            continue
        entries = []
        for lo in range(0, len(targets), ROWS_PER_CALL):
            block = targets[lo:lo + ROWS_PER_CALL]
            logits = model.compute_logits(hidden[offset + lo:offset + lo + len(block)])
            if report:
                entries.extend(rows_logprobs(logits, block, chunk.prompt_logprobs or 0))
        if report:
            result[chunk.request_id] = PromptLogprobs(chunk.start + 1, entries)
    return result
