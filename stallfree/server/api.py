"""The OpenAI-compatible HTTP API: `build_app(engine, served_model_name)` -> FastAPI app.

The app is assembled here (state, lifespan, error handlers, API key); its routes
live in `routes/`, one router per concern, and reach the state via `StateDep`.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from ..iteration_log import IterationLog
from .async_engine import AsyncEngine
from .config import RequestLimits
from .connections import log_accept_errors_once
from .engine_thread import EngineThread
from .errors import APIKeyMiddleware, document_400_not_422, install_error_handlers
from .limits import BodyLimitMiddleware
from .routes import ROUTERS
from .state import ServerState


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    log_accept_errors_once(asyncio.get_running_loop())
    yield
    # The engine thread (and a parallel engine's workers) stop with the server.
    state = app.state.stallfree
    state.tokenizers.shutdown()
    await asyncio.to_thread(state.engine.shutdown)


def build_app(engine: Any, served_model_name: str | Sequence[str] = "model",
              api_key: str | None = None, max_waiting_requests: int | None = None,
              model_root: str | None = None,
              iteration_log: IterationLog | None = None,
              limits: RequestLimits | None = None, public_metrics: bool = False,
              tokenizer_threads: int = 2,
              on_fatal: Callable[[], None] | None = None,
              engine_thread: EngineThread | None = None) -> FastAPI:
    """The API app around an `LLMEngine` (wrapped in an `AsyncEngine`) or an `AsyncEngine`.

    `max_waiting_requests` (sequences), `iteration_log`, `on_fatal` (run if the engine
    dies) and `engine_thread` (the thread that built the engine) go to the AsyncEngine
    made here; `limits` bound each request (default:
    `RequestLimits()`)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    if isinstance(engine, AsyncEngine) and (iteration_log is not None or on_fatal is not None
                                            or engine_thread is not None):
        raise ValueError("pass iteration_log, on_fatal and engine_thread to the AsyncEngine "
                         "itself")
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(
        engine, names[0], max_waiting_requests=max_waiting_requests, iteration_log=iteration_log,
        on_fatal=on_fatal, thread=engine_thread)

    app = FastAPI(title="stallfree", description="OpenAI-compatible LLM server "
                  "(chunked prefills, stall-free batching)", lifespan=_lifespan)
    limits = limits or RequestLimits()
    app.state.stallfree = ServerState(async_engine, names, model_root, limits, tokenizer_threads)
    install_error_handlers(app)
    # The last added runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes,
                       timeout=limits.body_timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, public_metrics=public_metrics)
    for router in ROUTERS:
        app.include_router(router)
    document_400_not_422(app)
    return app

