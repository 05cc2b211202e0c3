"""What the completion and chat routes share: a call's identity, and streaming its
outputs as server-sent events or collecting them into one response."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ...outputs import RequestOutput, StepOutput
from ...sampling_params import SamplingParams
from ..engine_call import Generation
from ..protocol import random_id
from ..state import ServerState
from ..streaming import collect_results, sse_response


@dataclass
class Call:
    """One API call: its engine requests and what every chunk of its reply repeats."""

    id: str
    object: str  # of its streamed chunks
    created: int
    model: str
    gen: Generation

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A streamed chunk carrying one choice."""
        return {**self.head(), "choices": [choice], "usage": None}


async def start_call(state: ServerState, raw: Request, id_prefix: str, chunk_object: str,
                     model: str, prompts: Sequence[str | list[int]], params: SamplingParams,
                     arrival: float) -> Call:
    """Submits the call's prompts to the engine (an OpenAI error if it refuses)."""
    call_id = random_id(id_prefix)
    created = int(time.time())
    gen = await state.start(call_id, prompts, params, arrival, raw)
    return Call(call_id, chunk_object, created, model, gen)


async def reply(state: ServerState, raw: Request, call: Call, body: Any, preamble: list[dict],
                to_chunk: Callable[[int, StepOutput], Any],
                to_response: Callable[[list[RequestOutput], Any], Any]) -> Any:
    """Streams the call (`preamble`, then `to_chunk` of each step output: a chunk, or an
    awaitable of one) when the body asks for it, else waits for every final output and
    answers `to_response(finals, tokenizer)`, built on a tokenizer thread (logprobs
    decode a token each)."""
    if body.stream:
        return sse_response(call.gen, preamble, to_chunk,
                            call.head() if body.include_usage else None)
    finals = await collect_results(raw, call.gen)
    if finals is None:  # the client left
        return Response(status_code=499)
    return await state.offload(lambda tok: to_response(finals, tok))
