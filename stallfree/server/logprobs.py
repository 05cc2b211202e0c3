"""OpenAI's two logprobs formats (legacy completions, chat) and vLLM's prompt_logprobs,
from the engine's records."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..outputs import TokenLogprobs

Decode = Callable[[int], str]


def top_by_text(top: list[tuple[int, float]], decode: Decode) -> dict[str, float]:
    """Legacy top_logprobs, text -> logprob. Tokens can decode to the same text (the byte
    pieces of one character, say): the most likely keeps the key, so the best logprob
    shown is the true best (what lm-eval's greedy check compares against)."""
    by_text: dict[str, float] = {}
    for token_id, logprob in top:
        by_text.setdefault(decode(token_id), logprob)
    return by_text


def _legacy(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], decode: Decode,
            text_offset: int) -> dict[str, list[Any]]:
    tokens, offsets = [], []
    for token_id in token_ids:
        offsets.append(text_offset)
        token = decode(token_id)
        tokens.append(token)
        text_offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else top_by_text(e.top, decode) for e in entries],
            "text_offset": offsets}


def completion_logprobs(steps: list[TokenLogprobs], decode: Decode,
                        text_offset: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset}, as in OpenAI's legacy API."""
    return _legacy([s.token_id for s in steps], steps, decode, text_offset)


def echoed_logprobs(prompt_ids: Sequence[int], table: Sequence[TokenLogprobs | None],
                    steps: list[TokenLogprobs], decode: Decode, text_offset: int) -> dict:
    """The legacy format over an echoed prompt and then its generated tokens (from
    `text_offset`, where the echo ends): the prompt's first token has no logprob and no
    alternatives (null), as in OpenAI's API."""
    prompt = _legacy(prompt_ids, table, decode, 0)
    generated = completion_logprobs(steps, decode, text_offset)
    return {key: prompt[key] + generated[key] for key in prompt}


def prompt_logprobs_field(prompt_ids: Sequence[int], table: Sequence[TokenLogprobs | None],
                          decode: Decode) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first), or {token id: {logprob,
    rank, decoded_token}} for the token itself and then its top alternatives."""
    def entry(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)}

    field: list[dict[str, dict[str, Any]] | None] = []
    for token_id, e in zip(prompt_ids, table):
        if e is None:
            field.append(None)
            continue
        position = {str(token_id): entry(e.logprob, e.rank, token_id)}
        for rank, (alt, logprob) in enumerate(e.top, 1):
            position.setdefault(str(alt), entry(logprob, rank, alt))
        field.append(position)
    return field


def chat_logprobs(steps: list[TokenLogprobs], decode: Decode) -> dict:
    """{content: [{token, logprob, bytes, top_logprobs}]}, as in OpenAI's chat API."""
    def entry(token_id: int, logprob: float) -> dict:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(s.token_id, s.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in steps]}
