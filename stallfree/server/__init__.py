"""The OpenAI-compatible HTTP server (`stallfree serve`).

Importing this package is cheap: FastAPI, uvicorn and torch load only when a
server is built (`build_app`) or run (`serve`).
"""
from .config import DEFAULT_SERVED_MODEL_NAME, ServerConfig
from .serve import serve

__all__ = ["ServerConfig", "serve", "build_app", "AsyncEngine", "DEFAULT_SERVED_MODEL_NAME"]


def __getattr__(name: str):
    if name == "build_app":
        from .api import build_app
        return build_app
    if name == "AsyncEngine":
        from .async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
