"""POST /tokenize and /detokenize: the served model's tokenizer and chat template."""
from __future__ import annotations

from fastapi import APIRouter

from ..errors import ERROR_RESPONSES, APIError
from ..protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    conversation_of,
)
from ..state import StateDep

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest,
                   state: StateDep) -> TokenizeResponse:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt",
                       code="invalid_value")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        ids = await state.apply_chat_template(conversation_of(body.messages),
                                              body.add_generation_prompt, tools or None)
    else:
        ids = await state.tokenize(body.prompt, body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest,
                     state: StateDep) -> DetokenizeResponse:
    state.check_model(body.model)
    state.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await state.decode(body.tokens))
