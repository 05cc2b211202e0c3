"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .structured_outputs import KINDS, StructuredOutputs

# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): dividing logits by
# a smaller one overflows float32 (1e-40 is a denormal; logits / 1e-40 are inf or NaN),
# and at 1e-5 the softmax already puts all the mass on the argmax.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; mirrors the OpenAI/vLLM field names.

    temperature 0 means greedy, and so does any temperature below GREEDY_TEMPERATURE
    (1e-5). Every bad value raises ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # 0: the prompt only (to read its prompt_logprobs)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    # False keeps special tokens' text in the output (vLLM's field): what tool-call formats
    # written with special tokens (Mistral's [TOOL_CALLS], Llama 3.1's <|python_tag|>) need.
    # The token that ends a sequence (EOS, stop_token_ids) is left out all the same.
    skip_special_tokens: bool = True
    # Return the sampled token's log-probability plus this many most likely
    # alternatives per step; None returns none.
    logprobs: int | None = None
    # Return every prompt token's log-probability given the tokens before it (the first
    # has none) plus this many most likely alternatives per position; None returns none.
    # As vLLM's prompt_logprobs: what scoring (lm-eval's loglikelihood) reads.
    prompt_logprobs: int | None = None
    # Constrained decoding: a JSON schema, regex, choice or grammar the output must match
    # (a StructuredOutputs, or a dict of its fields such as {"regex": "[0-9]+"}).
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None
    # This request's own time-between-tokens target in seconds (an engine with tbt_slo
    # only): every iteration it decodes in keeps to the tightest target among its requests.
    tbt_slo: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1 (disabled) or >= 1")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        # 64 bits, what torch's generators and the workers' messages carry.
        check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
              "seed", "must be an integer in [-2**63, 2**64) or None")
        # 0 computes the prompt and generates nothing: scoring it (with prompt_logprobs).
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
              "max_tokens", "must be an integer >= 0 or None")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              "must be an integer >= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", "must not exceed max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative integers")
        check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              "logprobs", "must be an integer in [0, 20] or None")
        check(self.prompt_logprobs is None
              or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", "must be an integer in [0, 20] or None")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens",
              "must be a bool")
        check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", "must be > 0")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              "presence_penalty", "must be in [-2, 2]")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              "frequency_penalty", "must be in [-2, 2]")
        check(self.tbt_slo is None or (_is_num(self.tbt_slo) and 0 < self.tbt_slo < math.inf),
              "tbt_slo", "must be a positive number of seconds or None")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputs), "structured_outputs",
              "must be a StructuredOutputs or a dict of its fields")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _structured(fields: dict[str, Any]) -> StructuredOutputs:
    unknown = set(fields) - set(KINDS)
    if unknown:
        raise ValueError(f"structured_outputs takes the keys {', '.join(KINDS)}, "
                         f"got {', '.join(map(str, sorted(unknown)))}")
    return StructuredOutputs(**fields)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN
