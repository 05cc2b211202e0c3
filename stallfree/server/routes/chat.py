"""POST /v1/chat/completions: the chat template applied, then generated like a completion."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request

from ...outputs import CompletionOutput, RequestOutput, StepOutput
from ..body import ParseFirstRoute
from ..errors import ERROR_RESPONSES
from ..logprobs import chat_logprobs, prompt_logprobs_field
from ..protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    Usage,
)
from ..state import ServerState, StateDep, token_decoder
from ..streaming import usage_of
from ..tool_parser import ToolCallParser
from ..tool_parser_registry import AUTO, choose_tool_parser
from ..tool_parser_specials import SpecialTexts, special_token_texts
from ..tools import Reply, TextReply, ToolUse
from .generation import reply, start_call

router = APIRouter(route_class=ParseFirstRoute)  # bodies parsed first (server/body.py)


def _tool_parser(raw: Request, state: ServerState) -> ToolCallParser:
    """How the app's model writes tool calls: `app.state.tool_parser`, which `serve` sets
    from --tool-call-parser; an app built without one picks it from the chat template
    once, on first use."""
    app_state = raw.app.state
    parser = getattr(app_state, "tool_parser", None)
    if parser is None:
        parser = app_state.tool_parser = choose_tool_parser(AUTO, state.llm_engine.tokenizer)
    return parser


def _keeps_special_tokens(body: ChatCompletionRequest, tools: ToolUse | None,
                          parser: ToolCallParser) -> bool:
    """Whether special tokens are kept in this request's text for its tool-call parser,
    whose markers are special tokens (as vLLM's parsers adjust a request). A client that
    set skip_special_tokens itself gets what it asked for."""
    return (tools is not None and tools.choice != "none" and parser.needs_special_tokens
            and "skip_special_tokens" not in body.model_fields_set)


async def _stripped_specials(raw: Request, state: ServerState,
                             parser: ToolCallParser) -> SpecialTexts:
    """The special tokens stripped from the content of a reply whose special tokens were
    kept for `parser`: all the tokenizer's but the parser's own markers. Compiled once per app and
    parser, with a pool tokenizer (the engine thread decodes with its own meanwhile)."""
    app_state = raw.app.state
    cache: dict[str, SpecialTexts] | None = getattr(app_state, "stripped_specials", None)
    if cache is None:
        cache = app_state.stripped_specials = {}
    if parser.name not in cache:
        texts = await state.offload(special_token_texts)
        cache[parser.name] = SpecialTexts.of(texts - set(parser.special_markers))
    return cache[parser.name]


def _choice(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, raw: Request,
                                 state: StateDep) -> Any:
    arrival = time.monotonic()
    model, params = state.check_request(body)
    tools = body.tool_use()
    await state.prepare_constraint(params, tools)
    parser = None if tools is None else _tool_parser(raw, state)
    specials = None
    if parser is not None and _keeps_special_tokens(body, tools, parser):
        params = dataclasses.replace(params, skip_special_tokens=False)
        specials = await _stripped_specials(raw, state, parser)
    ids = await state.apply_chat_template(body.conversation(), True,
                                          None if tools is None else tools.template_tools())
    call = await start_call(state, raw, "chatcmpl", "chat.completion.chunk", model, [ids],
                            params, arrival)
    # Each choice's text becomes content and/or tool calls (tools.py).
    replies: list[Reply] = [TextReply() if tools is None or parser is None
                            else tools.reply(parser, specials) for _ in range(params.n)]

    def step_chunk(_: int, item: StepOutput) -> Any:
        delta, finish = replies[item.index].delta(item.new_text, item.finish_reason)
        if item.logprobs is None:
            return call.chunk(_choice(item.index, delta, finish))
        return state.offload(lambda tok: call.chunk(_choice(
            item.index, delta, finish, chat_logprobs(item.logprobs, token_decoder(tok)))))

    def response(finals: list[RequestOutput], tok: Any) -> ChatCompletionResponse:
        decode = token_decoder(tok)

        def choice(o: CompletionOutput) -> ChatCompletionChoice:
            message, finish = replies[o.index].message(o.text, o.finish_reason)
            return ChatCompletionChoice(index=o.index, message=ChatResponseMessage(**message),
                                        logprobs=None if o.logprobs is None else chat_logprobs(
                                            o.logprobs, decode),
                                        finish_reason=finish)

        choices = [choice(o) for o in finals[0].outputs]
        final = finals[0]
        prompt = None if final.prompt_logprobs is None else prompt_logprobs_field(
            final.prompt_token_ids, final.prompt_logprobs, decode)
        return ChatCompletionResponse(id=call.id, created=call.created, model=model,
                                      choices=choices, usage=Usage(**usage_of(finals)),
                                      prompt_logprobs=prompt)

    # Each choice's stream opens with the assistant's role, as OpenAI's does.
    roles = [call.chunk(_choice(j, {"role": "assistant", "content": ""}, None))
             for j in range(params.n)]
    return await reply(state, raw, call, body, roles, step_chunk, response)
