"""POST /v1/chat/completions: the chat template applied, then generated like a completion."""
from __future__ import annotations

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
from ..tools import TextReply
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
    ids = await state.apply_chat_template(body.conversation(), True,
                                          None if tools is None else tools.template_tools())
    call = await start_call(state, raw, "chatcmpl", "chat.completion.chunk", model, [ids],
                            params, arrival)
    # Each choice's text becomes content and/or tool calls (tools.py).
    parser = None if tools is None else _tool_parser(raw, state)
    replies = [TextReply() if tools is None else tools.reply(parser) for _ in range(params.n)]

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
