"""Bounded work per request: the body's size (413) and time (408), and what one request
may ask (400).

Each refusal names its limit and the flag that sets it, so a client knows what to
change and an operator what to raise.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ..sampling_params import SamplingParams
from .config import RequestLimits
from .errors import APIError, error_response

DRAIN_FACTOR = 4  # a refused body is read (not kept) up to this many times the limit


def refuse(param: str, message: str, flag: str) -> None:
    """A 400 for a limit: what was asked, the limit, and the flag that sets it."""
    raise APIError(400, f"{message} (this server's --{flag})", param=param,
                   code="limit_exceeded")


def check_num_prompts(limits: RequestLimits, num_prompts: int) -> None:
    if num_prompts > limits.max_prompts:
        refuse("prompt", f"{num_prompts} prompts in one request; at most {limits.max_prompts}",
               "max-prompts")


def check_request_limits(limits: RequestLimits, params: SamplingParams,
                         num_prompts: int = 1) -> None:
    """Raises a 400 APIError for the first limit the request exceeds."""
    check_num_prompts(limits, num_prompts)
    if num_prompts * params.n > limits.max_sequences:
        refuse("n", f"{num_prompts} prompt(s) x n={params.n} asks for "
                    f"{num_prompts * params.n} sequences; at most {limits.max_sequences}",
               "max-sequences")
    if len(params.stop) > limits.max_stop_strings:
        refuse("stop", f"{len(params.stop)} stop strings; at most {limits.max_stop_strings}",
               "max-stop-strings")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_length:
        refuse("stop", f"a stop string of {longest} characters; at most "
                       f"{limits.max_stop_length}", "max-stop-length")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        refuse("stop_token_ids", f"{len(params.stop_token_ids)} stop_token_ids; at most "
                                 f"{limits.max_stop_token_ids}", "max-stop-token-ids")
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > limits.max_logprobs:
            refuse(name, f"{asked} top logprobs per token; at most {limits.max_logprobs}",
                   "max-logprobs")


class BodyLimitMiddleware:
    """Answers 413 to a body over `max_bytes`, declared (Content-Length) or streamed
    (chunked), before any of it is parsed, and 408 to one not whole within
    `timeout` seconds (a trickled body holds a connection and a task); the body read is
    replayed to the app."""

    def __init__(self, app: Any, max_bytes: int, timeout: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.timeout):
                whole = await self._read(scope, receive, send, chunks)
        except TimeoutError:
            response = error_response(408, f"the request body took over {self.timeout:g} s "
                                           "(this server's --body-timeout)",
                                      code="limit_exceeded", headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        if not whole:
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later calls wait for the disconnect, as before

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive: Any, send: Any, chunks: list[bytes]) -> bool:
        """Reads the body into `chunks`: False if it was refused or the client left."""
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, message.get("more_body", False))
                return False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return True

    async def _refuse(self, scope: dict, receive: Any, send: Any, more: bool = True) -> None:
        # Most clients read no answer before they have sent their whole body: take (and
        # drop) a bounded rest of it (`more`: some is still to come), so that they see the
        # 413 rather than a reset.
        drained = 0
        while more and drained <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                break
            more = message.get("more_body", False)
            drained += len(message.get("body", b""))
        response = error_response(413, f"the request body exceeds {self.max_bytes} bytes "
                                       "(this server's --max-body-bytes)",
                                  code="limit_exceeded", headers={"Connection": "close"})
        await response(scope, receive, send)
