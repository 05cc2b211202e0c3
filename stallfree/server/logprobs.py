"""OpenAI's two logprobs formats (legacy completions, chat) from the engine's records."""
from __future__ import annotations

from collections.abc import Callable

from ..outputs import TokenLogprobs

Decode = Callable[[int], str]


def completion_logprobs(steps: list[TokenLogprobs], decode: Decode,
                        text_offset: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}, as in OpenAI's legacy API."""
    tokens, offsets = [], []
    for step in steps:
        offsets.append(text_offset)
        token = decode(step.token_id)
        tokens.append(token)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [{decode(t): lp for t, lp in s.top} for s in steps],
            "text_offset": offsets}


def chat_logprobs(steps: list[TokenLogprobs], decode: Decode) -> dict:
    """{content: [{token, logprob, bytes, top_logprobs}]}, as in OpenAI's chat API."""
    def entry(token_id: int, logprob: float) -> dict:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(s.token_id, s.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in steps]}
