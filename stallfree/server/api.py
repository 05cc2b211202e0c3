"""The OpenAI-compatible HTTP API: `build_app(engine, served_model_name)` -> FastAPI app."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..iteration_log import IterationLog
from ..outputs import StepOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, Generation, QueueFullError
from .errors import (
    APIError,
    APIKeyMiddleware,
    bad_value,
    document_400_not_422,
    error_response,
    install_error_handlers,
)
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import CONTENT_TYPE
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    random_id,
)
from .streaming import collect_results, sse_response, usage_of

logger = logging.getLogger("stallfree.server")

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

    def check_request(self, body: Any) -> tuple[str, SamplingParams]:
        """The served model's name and the request's validated sampling parameters."""
        model = self.check_model(body.model)
        try:
            params = body.sampling_params()
        except ValueError as exc:
            raise bad_value(exc) from exc
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        return model, params

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
            raise bad_value(exc, "prompt") from exc
        except QueueFullError as exc:
            raise APIError(503, str(exc), "server_error", code="queue_full") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
        return gen




_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Bad request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "Engine failure"},
    503: {"model": ErrorResponse, "description": "Queue full or engine stopped"},
}


def build_app(engine: Any, served_model_name: str | Sequence[str] = "model",
              api_key: str | None = None, max_waiting_requests: int | None = None,
              model_root: str | None = None,
              iteration_log: IterationLog | None = None) -> FastAPI:
    """The API app around an `LLMEngine` (wrapped in an `AsyncEngine`) or an `AsyncEngine`."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    if isinstance(engine, AsyncEngine) and iteration_log is not None:
        raise ValueError("pass iteration_log to the AsyncEngine itself")
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(
        engine, names[0], max_waiting_requests=max_waiting_requests, iteration_log=iteration_log)
    state = _State(async_engine, names, model_root)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="stallfree", description="OpenAI-compatible LLM server "
                  "(chunked prefills, stall-free batching)", lifespan=lifespan)
    app.state.stallfree = state
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # ---- completions ----------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        model, params = state.check_request(body)
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
            return sse_response(gen, echoed, step_chunk,
                                {"id": cid, "object": "text_completion", "created": created,
                                 "model": model} if body.include_usage else None)

        finals = await collect_results(raw, gen)
        if finals is None:  # the client left
            return Response(status_code=499)
        choices = [CompletionChoice(index=i * n + o.index,
                                    text=(echo[i] if echo else "") + o.text,
                                    logprobs=None if o.logprobs is None else completion_logprobs(
                                        o.logprobs, state.decode_one, len(echo[i]) if echo else 0),
                                    finish_reason=o.finish_reason)
                   for i, f in enumerate(finals) for o in f.outputs]
        return CompletionResponse(id=cid, created=created, model=model, choices=choices,
                                  usage=Usage(**usage_of(finals)))

    # ---- chat completions -----------------------------------------------------
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        arrival = time.monotonic()
        model, params = state.check_request(body)
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

        def step_chunk(_: int, item: StepOutput) -> dict:
            delta = {"content": item.new_text} if item.new_text else {}
            logprobs = (None if item.logprobs is None
                        else chat_logprobs(item.logprobs, state.decode_one))
            return chunk(item.index, delta, item.finish_reason, logprobs)

        if body.stream:
            roles = [chunk(j, {"role": "assistant", "content": ""}, None) for j in range(n)]
            return sse_response(gen, roles, step_chunk,
                                {"id": cid, "object": "chat.completion.chunk", "created": created,
                                 "model": model} if body.include_usage else None)

        finals = await collect_results(raw, gen)
        if finals is None:  # the client left
            return Response(status_code=499)
        choices = [ChatCompletionChoice(index=o.index,
                                        message=ChatResponseMessage(content=o.text),
                                        logprobs=None if o.logprobs is None else chat_logprobs(
                                            o.logprobs, state.decode_one),
                                        finish_reason=o.finish_reason)
                   for o in finals[0].outputs]
        return ChatCompletionResponse(id=cid, created=created, model=model, choices=choices,
                                      usage=Usage(**usage_of(finals)))

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
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _version
        try:
            return {"version": _version("stallfree")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    document_400_not_422(app)
    return app




__all__ = ["build_app", "APIError", "error_response"]
