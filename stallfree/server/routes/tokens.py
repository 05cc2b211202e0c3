"""POST /tokenize and /detokenize, GET /tokenizer_info: the served model's tokenizer and chat
template, for clients that tokenize on their side (lm-eval's remote tokenizer)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..body import ParseFirstRoute
from ..errors import ERROR_RESPONSES, APIError
from ..protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    conversation_of,
)
from ..state import StateDep

router = APIRouter(route_class=ParseFirstRoute)  # bodies parsed first (server/body.py)


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


# The special tokens a client may ask for by name (as transformers names them).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                  "mask_token")


def tokenizer_info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """What vLLM's /tokenizer_info serves: the tokenizer's class, its special tokens (text,
    and id beside), its chat template, and the longest sequence served."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__,
                            "model_max_length": max_model_len,
                            "chat_template": getattr(tokenizer, "chat_template", None)}
    for name in SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        if isinstance(token, str):
            info[name] = token
            info[f"{name}_id"] = tokenizer.convert_tokens_to_ids(token)
    extra = getattr(tokenizer, "additional_special_tokens", None) or []
    info["additional_special_tokens"] = [str(t) for t in extra]
    return info


@router.get("/tokenizer_info", responses={401: ERROR_RESPONSES[401]})
async def get_tokenizer_info(state: StateDep) -> dict[str, Any]:
    return await state.offload(tokenizer_info, state.max_model_len)
