"""POST /v1/completions: OpenAI's legacy completions, streamed or whole."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from ...outputs import RequestOutput, StepOutput
from ..errors import ERROR_RESPONSES
from ..logprobs import completion_logprobs
from ..protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from ..state import StateDep, token_decoder
from ..streaming import usage_of
from .generation import reply, start_call

router = APIRouter()


def _choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, raw: Request,
                            state: StateDep) -> Any:
    arrival = time.monotonic()
    prompts = body.prompts()
    model, params = state.check_request(body, len(prompts))
    await state.prepare_constraint(params)
    for p in prompts:
        if not isinstance(p, str):
            state.check_token_ids(p, "prompt")

    def tokenize_and_echo(tok: Any) -> tuple[list[list[int]], list[str] | None]:
        ids = [list(tok(p)["input_ids"]) if isinstance(p, str) else p for p in prompts]
        echo = ([p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)
                 for p in prompts] if body.echo else None)
        return ids, echo

    # Off the event loop: a long prompt takes a while to tokenize.
    ids, echo = await state.offload(tokenize_and_echo)
    call = await start_call(state, "cmpl", "text_completion", model, ids, params, arrival)
    # Choice i * n + j is sequence j of prompt i, as OpenAI numbers them.
    n = params.n
    offsets: dict[int, int] = {}  # text streamed so far per choice, for text_offset

    def step_chunk(i: int, item: StepOutput) -> Any:
        index = i * n + item.index
        offset = offsets.get(index, 0)
        offsets[index] = offset + len(item.new_text)
        if item.logprobs is None:
            return call.chunk(_choice(index, item.new_text, item.finish_reason))
        return state.offload(lambda tok: call.chunk(_choice(
            index, item.new_text, item.finish_reason,
            completion_logprobs(item.logprobs, token_decoder(tok), offset))))

    def response(finals: list[RequestOutput], tok: Any) -> CompletionResponse:
        decode = token_decoder(tok)
        choices = [CompletionChoice(index=i * n + o.index,
                                    text=(echo[i] if echo else "") + o.text,
                                    logprobs=None if o.logprobs is None else completion_logprobs(
                                        o.logprobs, decode, len(echo[i]) if echo else 0),
                                    finish_reason=o.finish_reason)
                   for i, f in enumerate(finals) for o in f.outputs]
        return CompletionResponse(id=call.id, created=call.created, model=model,
                                  choices=choices, usage=Usage(**usage_of(finals)))

    echoed = [call.chunk(_choice(i * n + j, text, None)) for i, text in enumerate(echo or [])
              for j in range(n)]
    return await reply(state, raw, call, body, echoed, step_chunk, response)
