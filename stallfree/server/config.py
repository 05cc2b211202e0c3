"""The server's settings (`stallfree serve` flags besides the engine's): one dataclass.

Like the engine's (`stallfree/config.py`), each field carries its default and help,
and the command line builds one flag per field from them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..config import option

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "STALLFREE_API_KEY"


def parse_port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not a port number: {text!r}") from None
    _check_port(value)
    return value


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def _check_port(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {value!r}")


def _check_names(value: Any) -> list[str]:
    """A list of served names (one name alone is accepted as a list of one)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names \
            or not all(isinstance(name, str) and name for name in names):
        raise ValueError("served_model_name must be a non-empty list of non-empty names, "
                         f"got {value!r}")
    return list(names)


def _api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV)


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind (default 127.0.0.1)")
    port: int = option(8000, "port to listen on", parse=parse_port)
    api_key: str | None = option(
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
        default_factory=_api_key_from_env)
    served_model_name: list[str] | None = option(
        None, "model name(s) clients use; the first is reported "
              f"(default: the model path, or {DEFAULT_SERVED_MODEL_NAME})", nargs="+")
    max_waiting_requests: int | None = option(
        None, "answer 503 while this many sequences wait (default: unbounded)",
        parse=parse_positive_int)
    iteration_log: str | None = option(
        None, "write every engine iteration (batch shape, wall and CPU time) to PATH as "
              "JSON lines; `stallfree simulate replay` reads it", metavar="PATH")
    uvicorn_log_level: str = option("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        _check_port(self.port)
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ValueError(f"api_key must be a string or None, got {self.api_key!r}")
        if self.served_model_name is not None:
            self.served_model_name = _check_names(self.served_model_name)
        waiting = self.max_waiting_requests
        if waiting is not None and (not isinstance(waiting, int) or isinstance(waiting, bool)
                                    or waiting < 1):
            raise ValueError(f"max_waiting_requests must be a positive integer or None, "
                             f"got {waiting!r}")
        if self.iteration_log is not None and not isinstance(self.iteration_log,
                                                             (str, os.PathLike)):
            raise ValueError(f"iteration_log must be a path or None, got {self.iteration_log!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")

    def served_names(self, model: str | None) -> list[str]:
        """The names clients may use: those given, else the model's path (or the default's)."""
        return list(self.served_model_name or [model or DEFAULT_SERVED_MODEL_NAME])
