"""The OpenAI-compatible HTTP API: `build_app(engine, served_model_name)` -> FastAPI app.

The app is assembled here (state, lifespan, error handlers, API key); its routes
live in `routes/`, one router per concern, and reach the state via `StateDep`.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from ..iteration_log import IterationLog
from .async_engine import AsyncEngine
from .errors import APIKeyMiddleware, document_400_not_422, install_error_handlers
from .routes import ROUTERS
from .state import ServerState


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    # The engine thread (and a parallel engine's workers) stop with the server.
    await asyncio.to_thread(app.state.stallfree.engine.shutdown)


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

    app = FastAPI(title="stallfree", description="OpenAI-compatible LLM server "
                  "(chunked prefills, stall-free batching)", lifespan=_lifespan)
    app.state.stallfree = ServerState(async_engine, names, model_root)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    for router in ROUTERS:
        app.include_router(router)
    document_400_not_422(app)
    return app

