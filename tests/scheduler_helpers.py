"""Builders shared by the scheduler tests (no torch)."""
from __future__ import annotations

from stallfree.request import Request
from stallfree.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int | None = 16, arrival: float = 0.0,
                 eos: frozenset[int] = frozenset(), **params) -> Request:
    return Request(rid, [100 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, **params), arrival, eos_token_ids=eos)
