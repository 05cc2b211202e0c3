"""The server's settings (`stallfree serve` flags besides the engine's): one dataclass.

Like the engine's (`stallfree/config.py`), each field carries its default and help,
and the command line builds one flag per field from them.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .. import env
from ..config import option, parse_size
from ..structured_outputs import CompileLimits
from .tool_parser_registry import TOOL_CALL_PARSERS, check_tool_call_parser

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = env.API_KEY


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
    return env.api_key()


_COMPILE = CompileLimits()

# The request schema's own caps (server/protocol.py): a limit may lower them, not raise them.
SCHEMA_MAX_STOP = 16
SCHEMA_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server; each is refused with a 400 naming its flag
    (413 for the body). The defaults fit any honest client of a ~100K-token model."""

    max_body_bytes: int = 4 << 20  # a 100K-token prompt as token ids is ~700 KB of JSON
    max_prompts: int = 64  # prompts in one completion request
    max_sequences: int = 256  # prompts x n of one request
    max_stop_strings: int = SCHEMA_MAX_STOP
    max_stop_length: int = 256  # characters of one stop string (searched every token)
    max_stop_token_ids: int = 64
    max_logprobs: int = SCHEMA_MAX_LOGPROBS
    # Structured outputs (stallfree.structured_outputs.CompileLimits, same names).
    max_constraint_bytes: int = _COMPILE.max_constraint_bytes
    max_grammar_compile_seconds: int = _COMPILE.max_grammar_compile_seconds
    max_grammar_bytes: int = _COMPILE.max_grammar_bytes
    grammar_cache_bytes: int = _COMPILE.grammar_cache_bytes
    # A body that trickles in holds its connection and a task: bounded (408 beyond).
    body_timeout: int = 60  # seconds; a 4 MiB body at 1 Mbit/s takes ~35

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (
                    value == 0 and f.name != "max_logprobs"):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if self.max_stop_strings > SCHEMA_MAX_STOP:
            raise ValueError(f"max_stop_strings may not exceed the schema's {SCHEMA_MAX_STOP}, "
                             f"got {self.max_stop_strings}")
        if self.max_logprobs > SCHEMA_MAX_LOGPROBS:
            raise ValueError(f"max_logprobs may not exceed the schema's {SCHEMA_MAX_LOGPROBS}, "
                             f"got {self.max_logprobs}")


_LIMITS = RequestLimits()


@dataclass(frozen=True)
class ConnectionLimits:
    """What the server's sockets may hold (server/connections.py): idle sockets cost a file
    descriptor each, and a server out of descriptors answers nobody, /health included."""

    max_connections: int = 4096  # open client sockets (fewer if the fd limit is lower)
    header_timeout: int = 10  # seconds from connecting (or a reply) to a request's headers

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


_CONNECTIONS = ConnectionLimits()


@dataclass
class ServerConfig:
    host: str = option("127.0.0.1", "address to bind (default 127.0.0.1)")
    port: int = option(8000, "port to listen on", parse=parse_port)
    api_key: str | None = option(
        help="require 'Authorization: Bearer KEY' on every route but /health "
             f"(default: ${API_KEY_ENV})", default_factory=_api_key_from_env)
    public_metrics: bool = option(
        False, "serve /metrics without the API key (for scrapers that cannot send one)")
    served_model_name: list[str] | None = option(
        None, "model name(s) clients use; the first is reported "
              f"(default: the model path, or {DEFAULT_SERVED_MODEL_NAME})", nargs="+")
    max_waiting_requests: int | None = option(
        1024, "answer 503 when a request's sequences would make more than this many wait",
        parse=parse_positive_int)
    max_body_bytes: int = option(_LIMITS.max_body_bytes, "largest request body (413 beyond)",
                                 parse=parse_size)
    max_prompts: int = option(_LIMITS.max_prompts, "prompts in one completion request",
                              parse=parse_positive_int)
    max_sequences: int = option(_LIMITS.max_sequences,
                                "sequences one request may ask for (prompts x n)",
                                parse=parse_positive_int)
    max_stop_strings: int = option(_LIMITS.max_stop_strings,
                                   f"stop strings per request (at most {SCHEMA_MAX_STOP})",
                                   parse=parse_positive_int)
    max_stop_length: int = option(_LIMITS.max_stop_length, "characters in one stop string",
                                  parse=parse_positive_int)
    max_stop_token_ids: int = option(_LIMITS.max_stop_token_ids, "stop_token_ids per request",
                                     parse=parse_positive_int)
    max_logprobs: int = option(_LIMITS.max_logprobs,
                               f"top logprobs per token (at most {SCHEMA_MAX_LOGPROBS})", parse=int)
    max_constraint_bytes: int = option(
        _LIMITS.max_constraint_bytes, "bytes of one request's constraint (JSON schema, regex, "
                                      "choices, grammar), refused before compiling",
        parse=parse_size)
    max_grammar_compile_seconds: int = option(
        _LIMITS.max_grammar_compile_seconds, "seconds one grammar may compile; a longer "
                                             "compile is killed and its request refused",
        parse=parse_positive_int)
    max_grammar_bytes: int = option(_LIMITS.max_grammar_bytes,
                                    "memory of one compiled grammar (larger: refused)",
                                    parse=parse_size)
    grammar_cache_bytes: int = option(
        _LIMITS.grammar_cache_bytes, "memory of the compiled grammars kept for reuse "
                                     "(least recently used dropped)", parse=parse_size)
    body_timeout: int = option(_LIMITS.body_timeout, "seconds to receive a request's body "
                                                     "once its headers are in (408 beyond)",
                               parse=parse_positive_int)
    max_connections: int = option(
        _CONNECTIONS.max_connections, "open client connections; beyond, the longest idle one "
                                      "is closed (503 when none is idle); lowered to fit the "
                                      "open-file limit", parse=parse_positive_int)
    header_timeout: int = option(
        _CONNECTIONS.header_timeout, "seconds a connection may take to send a request's "
                                     "headers (then closed, 408 if it sent part)",
        parse=parse_positive_int)
    tokenizer_threads: int = option(
        2, "threads that tokenize, apply chat templates and decode logprobs off the event "
           "loop (each with its own tokenizer)", parse=parse_positive_int)
    iteration_log: str | None = option(
        None, "write every engine iteration (batch shape, wall and CPU time) to PATH as "
              "JSON lines; `stallfree simulate replay` reads it", metavar="PATH")
    uvicorn_log_level: str = option("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    tool_call_parser: str = option(
        "auto", "how the model writes tool calls (tool_choice auto): hermes (JSON in "
                "<tool_call> tags), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]); "
                "auto: from the chat template", choices=TOOL_CALL_PARSERS)

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
        self.limits()  # checks each limit
        self.connection_limits()
        threads = self.tokenizer_threads
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"tokenizer_threads must be a positive integer, got {threads!r}")
        if self.iteration_log is not None and not isinstance(self.iteration_log,
                                                             (str, os.PathLike)):
            raise ValueError(f"iteration_log must be a path or None, got {self.iteration_log!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                             f"got {self.uvicorn_log_level!r}")
        check_tool_call_parser(self.tool_call_parser)

    def limits(self) -> RequestLimits:
        return RequestLimits(**{f.name: getattr(self, f.name)
                                for f in dataclasses.fields(RequestLimits)})

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(**{f.name: getattr(self, f.name)
                                   for f in dataclasses.fields(ConnectionLimits)})

    def served_names(self, model: str | None) -> list[str]:
        """The names clients may use: those given, else the model's path (or the default's)."""
        return list(self.served_model_name or [model or DEFAULT_SERVED_MODEL_NAME])
