"""The OpenAI-compatible HTTP API: `build_app(engine, served_model_name)` -> FastAPI app."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..outputs import RequestOutput, StepOutput
from .async_engine import AsyncEngine, EngineDeadError, Generation, QueueFullError
from .metrics import CONTENT_TYPE
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatResponseMessage, CompletionChoice, CompletionRequest,
                       CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse, Usage, random_id)

logger = logging.getLogger("stallfree.server")

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                    "min_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "include_stop_str_in_output")


# ---- errors -----------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _bad_value(err: ValueError, default_param: str | None = None) -> APIError:
    message = str(err)
    param = getattr(err, "param", None)
    if param is None:
        first = message.split(" ", 1)[0]
        param = first if first in _SAMPLING_FIELDS else default_param
    return APIError(400, message, param=param, code="invalid_value")


_UNION_HINTS = {
    "prompt": "must be a non-empty string, a list of strings, a list of token ids "
              "(integers >= 0) or a list of such lists",
    "stop": "must be a string or a list of at most 16 strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line (and the offending field) for pydantic's errors."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    by_param: dict[str | None, list[dict]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ())]
        if loc[:1] == ["body"]:
            loc = loc[1:]
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return f"the body is not valid JSON: {detail}".strip(), None
        if not loc:
            if err.get("type") == "missing":
                return "the request body must be a JSON object", None
            return f"the request body {err.get('msg', 'is invalid').lower()}", None
        # Keep the field path; drop pydantic's union member tags ('str', 'list[int]', ...).
        path = [x for x in loc if not _is_type_tag(x)]
        # Errors inside a union field (prompt, stop, content) are reported as one.
        for i, x in enumerate(path):
            if x in _UNION_HINTS:
                path = path[:i + 1]
                break
        by_param.setdefault(".".join(path) or None, []).append(err)
    parts = []
    for param, errs in list(by_param.items())[:5]:
        leaf = (param or "").split(".")[-1]
        if len(errs) > 1 and leaf in _UNION_HINTS:
            parts.append(f"{param}: {_UNION_HINTS[leaf]}")
        else:
            parts.append(f"{param}: {errs[0].get('msg')}" if param else str(errs[0].get("msg")))
    if len(by_param) > 5:
        parts.append(f"... and {len(by_param) - 5} more fields")
    first = next(iter(by_param))
    return "; ".join(parts), first


def _is_type_tag(x: str) -> bool:
    return not x.isdigit() and (x in ("str", "int", "float", "bool", "list", "dict")
                                or "[" in x or "-" in x or x[:1].isupper())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}",
                              "server_error")


class _APIKeyMiddleware:
    """Every /v1 route requires `Authorization: Bearer KEY` (checked before anything else)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (
                scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                response = error_response(401, "invalid or missing API key: send "
                                          "'Authorization: Bearer <key>'", "invalid_request_error",
                                          code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
class _State:
    def __init__(self, engine: AsyncEngine, names: list[str], root: str | None) -> None:
        self.engine = engine
        self.names = names
        self.root = root
        self.created = int(time.time())

    @property
    def llm(self) -> Any:
        return self.engine.engine

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.names:
            return self.names[0] if model is None else model
        raise APIError(404, f"The model `{model}` does not exist. Served: "
                       f"{', '.join(self.names)}", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, f"the engine has stopped ({self.engine.dead_reason})",
                           "server_error", code="engine_dead")

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text))

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True
                            ) -> list[int]:
        try:
            ids = self.llm.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as exc:  # jinja errors: e.g. roles the template refuses
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages",
                           code="invalid_value") from exc
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.llm.model_config.vocab_size
        if any(t >= vocab for t in ids):
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param,
                           code="invalid_value")

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_one(self, token_id: int) -> str:
        return self.decode([token_id])

    async def start(self, request_id: str, prompts: Sequence[str | list[int]], params: Any,
                    arrival: float) -> Generation:
        self.check_alive()
        gen = self.engine.generate(request_id, prompts, params, arrival)
        try:
            await gen.start()
        except ValueError as exc:
            raise _bad_value(exc, "prompt") from exc
        except QueueFullError as exc:
            raise APIError(503, str(exc), "server_error", code="queue_full") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        return gen


class _ClientGone(Exception):
    pass


async def _unless_disconnected(raw: Request, coro: Any) -> Any:
    """Awaits `coro`, cancelling it (which aborts its requests) if the client leaves."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise _ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _stream(gen: Any, preamble: list[dict], to_chunk: Callable[[int, StepOutput], dict],
            usage_head: dict | None) -> Response:
    """SSE body shared by both endpoints: preamble chunks, one chunk per step output,
    an optional usage chunk, then [DONE]. A client that leaves aborts the request."""
    async def events() -> AsyncIterator[str]:
        try:
            for item in preamble:
                yield _sse(item)
            async for i, item in gen.events():
                if isinstance(item, StepOutput):
                    yield _sse(to_chunk(i, item))
            if usage_head is not None:
                finals = list(gen.finals.values())
                yield _sse({**usage_head, "choices": [], "usage": _usage(finals),
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
    if isinstance(exc, EngineDeadError):
        body = {"message": str(exc), "type": "server_error", "param": None, "code": "engine_dead"}
    else:
        body = {"message": f"internal server error: {type(exc).__name__}: {exc}",
                "type": "server_error", "param": None, "code": None}
    return _sse({"error": body})


def _internal(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), "server_error", code="engine_dead")
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Bad request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "Engine failure"},
    503: {"model": ErrorResponse, "description": "Queue full or engine stopped"},
}


def build_app(engine: Any, served_model_name: str | Sequence[str] = "model",
              api_key: str | None = None, max_waiting_requests: int | None = None,
              model_root: str | None = None) -> FastAPI:
    """The API app around an `LLMEngine` (wrapped in an `AsyncEngine`) or an `AsyncEngine`."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(
        engine, names[0], max_waiting_requests=max_waiting_requests)
    state = _State(async_engine, names, model_root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="stallfree", description="OpenAI-compatible LLM server "
                  "(chunked prefills, stall-free batching)", lifespan=lifespan)
    app.state.stallfree = state
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    # ---- completions ----------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        model = state.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise _bad_value(exc) from exc
        state.check_token_ids(params.stop_token_ids, "stop_token_ids")
        prompts = body.prompts()
        for p in prompts:
            if not isinstance(p, str):
                state.check_token_ids(p, "prompt")
        # Off the event loop: a long prompt takes a while to tokenize.
        ids = await asyncio.to_thread(
            lambda: [state.tokenize(p) if isinstance(p, str) else p for p in prompts])
        echo = ([p if isinstance(p, str) else state.decode(p) for p in prompts]
                if body.echo else None)
        cid = random_id("cmpl")
        created = int(time.time())
        gen = await state.start(cid, ids, params, arrival)
        n = params.n

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}], "usage": None}

        offsets: dict[int, int] = {}  # text streamed so far per choice, for text_offset

        def step_chunk(i: int, item: StepOutput) -> dict:
            index = i * n + item.index
            logprobs = None
            if item.logprobs is not None:
                logprobs = completion_logprobs(item.logprobs, state.decode_one,
                                               offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(item.new_text)
            return chunk(index, item.new_text, item.finish_reason, logprobs)

        if body.stream:
            echoed = [chunk(i * n + j, text, None) for i, text in enumerate(echo or [])
                      for j in range(n)]
            return _stream(gen, echoed, step_chunk,
                           {"id": cid, "object": "text_completion", "created": created,
                            "model": model} if body.include_usage else None)

        try:
            finals = await _unless_disconnected(raw, gen.results())
        except _ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            raise _internal(exc) from exc
        choices = [CompletionChoice(index=i * n + o.index,
                                    text=(echo[i] if echo else "") + o.text,
                                    logprobs=None if o.logprobs is None else completion_logprobs(
                                        o.logprobs, state.decode_one, len(echo[i]) if echo else 0),
                                    finish_reason=o.finish_reason)
                   for i, f in enumerate(finals) for o in f.outputs]
        return CompletionResponse(id=cid, created=created, model=model, choices=choices,
                                  usage=Usage(**_usage(finals)))

    # ---- chat completions -----------------------------------------------------
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        model = state.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise _bad_value(exc) from exc
        state.check_token_ids(params.stop_token_ids, "stop_token_ids")
        ids = await asyncio.to_thread(state.apply_chat_template, body.conversation())
        cid = random_id("chatcmpl")
        created = int(time.time())
        gen = await state.start(cid, [ids], params, arrival)
        n = params.n

        def chunk(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": index, "delta": delta,
                                                 "logprobs": logprobs, "finish_reason": finish}],
                    "usage": None}

        if body.stream:
            roles = [chunk(j, {"role": "assistant", "content": ""}, None) for j in range(n)]
            return _stream(gen, roles,
                           lambda _, item: chunk(
                               item.index, {"content": item.new_text} if item.new_text else {},
                               item.finish_reason, None if item.logprobs is None
                               else chat_logprobs(item.logprobs, state.decode_one)),
                           {"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": model} if body.include_usage else None)

        try:
            finals = await _unless_disconnected(raw, gen.results())
        except _ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            raise _internal(exc) from exc
        choices = [ChatCompletionChoice(index=o.index,
                                        message=ChatResponseMessage(content=o.text),
                                        logprobs=None if o.logprobs is None else chat_logprobs(
                                            o.logprobs, state.decode_one),
                                        finish_reason=o.finish_reason)
                   for o in finals[0].outputs]
        return ChatCompletionResponse(id=cid, created=created, model=model, choices=choices,
                                      usage=Usage(**_usage(finals)))

    # ---- the rest ---------------------------------------------------------------
    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=state.created, root=state.root,
                                         max_model_len=state.llm.max_model_len)
                               for name in names])

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> Any:
        if async_engine.is_dead:
            return error_response(503, f"the engine has stopped ({async_engine.dead_reason})",
                                  "server_error", code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt",
                           code="invalid_value")
        if body.messages is not None:
            ids = state.apply_chat_template([{"role": m.role, "content": m.text()}
                                             for m in body.messages],
                                            body.add_generation_prompt)
        else:
            ids = list(state.llm.tokenizer(body.prompt,
                                           add_special_tokens=body.add_special_tokens)["input_ids"])
        return TokenizeResponse(count=len(ids), max_model_len=state.llm.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        state.check_token_ids(body.tokens, "tokens")
        return DetokenizeResponse(prompt=state.decode(body.tokens))

    @app.get("/version")
    async def version() -> dict:
        from importlib.metadata import PackageNotFoundError, version as _version
        try:
            return {"version": _version("stallfree")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    _document_400_not_422(app)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """Our validation errors answer 400 (as OpenAI does): say so in the OpenAPI schema."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        for path in schema.get("paths", {}).values():
            for op in path.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    responses["400"] = {
                        "description": "Bad request",
                        "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        comps = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["build_app", "APIError", "error_response"]
