"""Server-sent events: one chunk per engine step, usage at the end, aborts on disconnect."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..outputs import RequestOutput, StepOutput
from .errors import internal_error

logger = logging.getLogger("stallfree.server")

class _SSEResponse(StreamingResponse):
    """Server-sent events that stop (and abort the request) as soon as the client leaves."""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def stream() -> None:
            try:
                await self.stream_response(send)
            except OSError:  # the client went away mid-send
                pass

        # Watch for the disconnect while streaming, whatever the ASGI spec version.
        stream_task = asyncio.ensure_future(stream())
        listen_task = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream_task, listen_task},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (stream_task, listen_task):
                task.cancel()
            await asyncio.gather(stream_task, listen_task, return_exceptions=True)
            await self.body_iterator.aclose()  # runs the generator's cleanup (abort)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- the app ----------------------------------------------------------------


class ClientGone(Exception):
    pass


async def unless_disconnected(raw: Request, coro: Any) -> Any:
    """Awaits `coro`, cancelling it (which aborts its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def usage_of(finals: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    # As OpenAI reports it: the prompt tokens served from the prefix cache.
    cached = sum(f.num_cached_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse_response(gen: Any, preamble: list[dict], to_chunk: Callable[[int, StepOutput], Any],
                 usage_head: dict | None) -> Response:
    """SSE body shared by both endpoints: preamble chunks, one chunk per step output
    (`to_chunk` returns it, or an awaitable of it when building it is work for a
    tokenizer thread), an optional usage chunk, then [DONE]. A client that leaves
    aborts the request."""
    async def events() -> AsyncIterator[str]:
        try:
            for item in preamble:
                yield _sse(item)
            async for i, item in gen.events():
                if isinstance(item, StepOutput):
                    chunk = to_chunk(i, item)
                    if inspect.isawaitable(chunk):
                        chunk = await chunk
                    yield _sse(chunk)
            if usage_head is not None:
                finals = list(gen.finals.values())
                yield _sse({**usage_head, "choices": [], "usage": usage_of(finals),
                            "metrics": _request_metrics(finals)})
        except Exception as exc:  # noqa: BLE001
            logger.warning("stream %s failed: %s", getattr(gen, "request_id", "?"), exc)
            yield _stream_error(exc)
        finally:
            if not gen.done:  # the client left (or the stream was closed) early
                gen.abort()
        yield "data: [DONE]\n\n"

    return _SSEResponse(events(), media_type="text/event-stream")


def _request_metrics(finals: list[RequestOutput]) -> dict[str, float | int | None]:
    """Server-side timings a benchmark client cannot see (an extension field)."""
    delays = [f.first_scheduled_time - f.arrival_time for f in finals
              if f.first_scheduled_time is not None]
    return {"scheduling_delay": max(delays) if delays else None,
            "num_preemptions": sum(o.num_preemptions for f in finals for o in f.outputs)}


def _stream_error(exc: BaseException) -> str:
    return _sse({"error": internal_error(exc).body()})


async def collect_results(raw: Request, gen: Any) -> list[RequestOutput] | None:
    """Every final output, or None when the client left first (its requests are
    aborted); an engine failure becomes a 500."""
    try:
        return await unless_disconnected(raw, gen.results())
    except ClientGone:
        return None
    except Exception as exc:  # noqa: BLE001
        raise internal_error(exc) from exc

