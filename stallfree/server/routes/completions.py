"""POST /v1/completions: OpenAI's legacy completions, streamed or whole."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from ...outputs import CompletionOutput, RequestOutput, StepOutput, TokenLogprobs
from ..body import ParseFirstRoute
from ..errors import ERROR_RESPONSES
from ..logprobs import (
    Decode,
    completion_logprobs,
    echoed_logprobs,
    prompt_logprobs_field,
)
from ..protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from ..state import StateDep, token_decoder
from ..streaming import usage_of
from .generation import reply, start_call

router = APIRouter(route_class=ParseFirstRoute)  # bodies parsed first (server/body.py)

PromptTable = list[TokenLogprobs | None]


def _choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class _Choices:
    """Builds one prompt's choices (whole or as stream deltas) from what the engine gave:
    the echoed prompt with its logprobs in OpenAI's legacy format, vLLM's prompt_logprobs,
    then the generated text and its logprobs."""

    def __init__(self, body: CompletionRequest, prompt_ids: list[int], echo: str | None) -> None:
        self.body = body
        self.prompt_ids = prompt_ids
        self.echo = echo

    def logprobs(self, steps: list[TokenLogprobs] | None, table: PromptTable | None,
                 offset: int, decode: Decode) -> dict | None:
        """Legacy logprobs of `steps` (generated, from text `offset`), after the echoed
        prompt's when `table` is given."""
        if self.body.logprobs is None:
            return None
        if table is None:
            return completion_logprobs(steps or [], decode, offset)
        return echoed_logprobs(self.prompt_ids, table, steps or [], decode, offset)

    def add_prompt_field(self, choice: dict, table: PromptTable | None, decode: Decode) -> dict:
        if self.body.prompt_logprobs is not None and table is not None:
            choice["prompt_logprobs"] = prompt_logprobs_field(self.prompt_ids, table, decode)
        return choice

    def whole(self, index: int, final: RequestOutput, out: CompletionOutput,
              decode: Decode) -> CompletionChoice:
        echo = self.echo or ""
        table = final.prompt_logprobs
        choice = _choice(index, echo + out.text, out.finish_reason,
                         self.logprobs(out.logprobs, table if self.echo is not None else None,
                                       len(echo), decode))
        return CompletionChoice(**self.add_prompt_field(choice, table, decode))


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
    call = await start_call(state, raw, "cmpl", "text_completion", model, ids, params, arrival)
    builders = [_Choices(body, ids[i], echo[i] if echo else None) for i in range(len(ids))]
    # Choice i * n + j is sequence j of prompt i, as OpenAI numbers them.
    n = params.n
    # An echo with logprobs waits for the prompt's logprobs, which come with the first
    # output; a plain echo goes out at once.
    echo_first = body.echo and body.logprobs is not None
    offsets: dict[int, int] = {}  # text streamed so far per choice, for text_offset
    tables: dict[int, PromptTable] = {}  # per prompt, from its first step output

    def step_chunk(i: int, item: StepOutput) -> Any:
        index = i * n + item.index
        if item.prompt_logprobs is not None:
            tables[i] = item.prompt_logprobs
        first = index not in offsets
        head = echo[i] if echo and first and echo_first else ""
        offset = offsets.get(index, len(echo[i]) if echo else 0)  # where new_text starts
        offsets[index] = offset + len(item.new_text)
        text = head + item.new_text
        wants_prompt = first and body.prompt_logprobs is not None
        if item.logprobs is None and not head and not wants_prompt:
            return call.chunk(_choice(index, text, item.finish_reason))
        table = tables.get(i) if first else None

        def build(tok: Any) -> dict:
            decode = token_decoder(tok)
            builder = builders[i]
            logprobs = builder.logprobs(item.logprobs, table if head else None, offset, decode)
            choice = _choice(index, text, item.finish_reason, logprobs)
            return call.chunk(builder.add_prompt_field(choice, table, decode))
        return state.offload(build)

    def response(finals: list[RequestOutput], tok: Any) -> CompletionResponse:
        decode = token_decoder(tok)
        choices = [builders[i].whole(i * n + o.index, f, o, decode)
                   for i, f in enumerate(finals) for o in f.outputs]
        return CompletionResponse(id=call.id, created=call.created, model=model,
                                  choices=choices, usage=Usage(**usage_of(finals)))

    echoed = [] if echo_first else [call.chunk(_choice(i * n + j, text, None))
                                    for i, text in enumerate(echo or []) for j in range(n)]
    return await reply(state, raw, call, body, echoed, step_chunk, response)
