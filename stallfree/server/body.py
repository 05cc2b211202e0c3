"""Request bodies: a large one is parsed and validated on a thread, and a prompt is
refused by its length before any of its token ids is looked at.

FastAPI parses and validates a body on the event loop. A 4 MiB list of 800K token ids
took ~60 ms to parse and ~250 ms to validate (the prompt's union tries each member over
every id), and eight at once kept /health and running streams waiting for seconds.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ..scheduler.base import prompt_length_error
from .config import RequestLimits
from .errors import APIError
from .limits import check_num_prompts

OFF_LOOP_BYTES = 64 << 10  # above this, a body is parsed and validated on a thread

# One thread: a parse holds the GIL throughout, so parses side by side would hand the GIL
# among themselves and keep the event loop (and the engine thread) from it; one after
# another, the loop gets a turn between them.
_PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stallfree-body")

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


def check_prompt_sizes(data: Any, max_model_len: int, limits: RequestLimits) -> None:
    """Refuses a `prompt` by its lengths alone (the number of prompts, the ids in one),
    as the request's own checks and the engine's would, before its ids are validated."""
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], int):
        prompts = [prompt]
    else:  # strings or id lists: one prompt each
        check_num_prompts(limits, len(prompt))
        prompts = [p for p in prompt if isinstance(p, list)]
    longest = max(len(p) for p in prompts) if prompts else 0
    reason = prompt_length_error(longest, max_model_len)  # the scheduler's own check
    if reason is not None:
        raise APIError(400, reason, param="prompt", code="invalid_value")


def _is_json(request: Request) -> bool:
    """FastAPI's test: parsed as JSON only with a JSON content type."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def _not_json(pos: int, why: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", pos),
                                    "msg": "JSON decode error", "input": {},
                                    "ctx": {"error": why}}])


def _parse(body: bytes, state: Any, route: APIRoute, validate: bool) -> Any:
    """The body as FastAPI would hand it to validation (the validated model when
    `validate`); raises what FastAPI's handler would for a bad one."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:  # FastAPI's own error, so the 400 reads the same
        raise _not_json(err.pos, err.msg) from None
    except UnicodeDecodeError as err:
        raise _not_json(err.start, f"not UTF-8 ({err.reason})") from None
    check_prompt_sizes(data, state.max_model_len, state.limits)
    if not validate or route.body_field is None:
        return data
    value, errors = route.body_field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    # A model instance: FastAPI's own validation passes it through without a second look.
    return value


def parse_first(route: APIRoute, handler: Handler) -> Handler:
    """`handler` behind a parse of the JSON body (on a thread when large), stored where
    FastAPI's handler reads it (`Request._json`, Starlette's cache of `request.json()`)."""
    async def parsed_then_handled(request: Request) -> Response:
        body = await request.body()
        if body and _is_json(request):
            state = request.app.state.stallfree
            if len(body) > OFF_LOOP_BYTES:
                request._json = await asyncio.get_running_loop().run_in_executor(
                    _PARSER, _parse, body, state, route, True)
            else:  # small: cheaper here than a thread's round trip
                request._json = _parse(body, state, route, False)
        return await handler(request)

    return parsed_then_handled


class ParseFirstRoute(APIRoute):
    """An APIRoute whose handler parses its body first (`parse_first`)."""

    def get_route_handler(self) -> Handler:
        return parse_first(self, super().get_route_handler())
