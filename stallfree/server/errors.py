"""OpenAI-style errors: the body shape, 400 for validation, API-key checks."""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_errors import EngineDeadError, RequestFailedError
from .protocol import ErrorResponse

logger = logging.getLogger("stallfree.server")

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                    "min_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "include_stop_str_in_output")


# What the routes document besides their success response.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Bad request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "Engine failure"},
    503: {"model": ErrorResponse, "description": "Queue full or engine stopped"},
}


# ---- errors -----------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object: {"message", "type", "param", "code"}."""
        return {"message": self.message, "type": self.type, "param": self.param,
                "code": self.code}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return _AsciiJSON(body, status_code=status, headers=headers)


class _AsciiJSON(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote what the client sent,
    and a lone surrogate in it has no UTF-8 form (the plain response would fail to encode
    and drop the connection), while its \\u escape is valid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_value(err: ValueError, default_param: str | None = None) -> APIError:
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
        # A value error (a lone surrogate in a string, say) says more than the union's shape.
        reasons = [e.get("msg") for e in errs if e.get("type") == "value_error"]
        if len(errs) > 1 and leaf in _UNION_HINTS and not reasons:
            parts.append(f"{param}: {_UNION_HINTS[leaf]}")
        elif reasons:
            parts.append(f"{param}: {reasons[0]}")
        else:
            parts.append(f"{param}: {errs[0].get('msg')}" if param else str(errs[0].get("msg")))
    if len(by_param) > 5:
        parts.append(f"... and {len(by_param) - 5} more fields")
    first = next(iter(by_param))
    return "; ".join(parts), first


def _is_type_tag(x: str) -> bool:
    return not x.isdigit() and (x in ("str", "int", "float", "bool", "list", "dict")
                                or "[" in x or "-" in x or x[:1].isupper())


def install_error_handlers(app: FastAPI) -> None:
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
        err = internal_error(exc)
        return error_response(err.status, err.message, err.type, err.param, err.code)




class APIKeyMiddleware:
    """Every route but /health (and /metrics when `public_metrics`) requires
    `Authorization: Bearer KEY`, checked before anything else: the tokenizer routes,
    the docs and the schema are the server's too."""

    def __init__(self, app: Any, api_key: str, public_metrics: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = {"/health"} | ({"/metrics"} if public_metrics else set())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # CORS preflights never carry credentials; no route answers them anyway.
        if scope["type"] == "http" and scope["method"] != "OPTIONS" \
                and scope["path"] not in self.open_paths:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                response = error_response(401, "invalid or missing API key: send "
                                          "'Authorization: Bearer <key>'", "invalid_request_error",
                                          code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def internal_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), "server_error", code="request_failed")
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")



def document_400_not_422(app: FastAPI) -> None:
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

