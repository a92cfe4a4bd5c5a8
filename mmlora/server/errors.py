"""OpenAI's error envelope for every error the server answers, and the API-key guard.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with OpenAI's types: ``type`` is
``invalid_request_error`` for a client error, ``requests`` for 429, ``server_error`` for 500 and
``service_unavailable_error`` for 503; ``param`` names the field at fault or is null; ``code`` is a string
(``model_not_found``, ``invalid_type``, ...) or null, never a number.

Bad input is always a 4xx: 400 for a request the server understands but refuses (bad values, mismatched
lengths, malformed JSON), 404 for an unknown model, adapter or route, 413 for a body over
``--max-request-bytes``, 422 for a body that does not match the schema; 401 for a missing or wrong key;
429/503 when the server cannot take more work.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from mmlora.engine.background import EngineUnavailableError, QueueFullError
from mmlora.lora.paths import AdapterFolderMissing
from mmlora.lora.refs import UnknownAdapterError

logger = logging.getLogger(__name__)

_TYPES = {429: "requests", 503: "service_unavailable_error"}
# pydantic error types -> OpenAI's codes for a parameter that is missing, unknown or of the wrong type
_VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
# loc entries pydantic adds for the member of a union that was tried ("list[str]", "constrained-int",
# a model's class name): not field names, which are snake_case
_PLAIN_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(status: int, message: str, **kwargs: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, **kwargs), status_code=status)


def to_api_error(exc: BaseException) -> APIError:
    """Map what the engine raises to an HTTP answer (ValueError is the engine's 'bad input')."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (QueueFullError, OverflowError)):  # the engine's own waiting queue is full
        return APIError(429, str(exc), code="rate_limit_exceeded")
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), code="unavailable")
    if isinstance(exc, UnknownAdapterError):
        if exc.param == "model":
            available = ", ".join(exc.registered) or "none"
            message = f"model {exc.key!r} not found; loaded adapters: {available}"
            return APIError(404, message, param="model", code="model_not_found")
        return APIError(404, str(exc), param=exc.param, code="lora_not_found")
    if isinstance(exc, AdapterFolderMissing):
        return APIError(404, str(exc), param=_param_of(str(exc)), code="lora_not_found")
    if isinstance(exc, LookupError):  # an adapter being unloaded answers as if it were already gone
        msg = str(exc).strip("'\"")
        return APIError(404, msg, param=_param_of(msg), code="lora_not_found")
    if isinstance(exc, (ValueError, TypeError)):
        msg = str(exc)
        return APIError(400, msg, param=_param_of(msg))
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def _param_of(message: str) -> str | None:
    """``"sampling_params.top_p: must be ..."`` -> ``"sampling_params.top_p"`` (best effort)."""
    head, sep, _ = message.partition(":")
    return head if sep and " " not in head and len(head) < 80 else None


def _loc(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"`` (union member tags left out)."""
    out = ""
    for part in loc:
        if part in ("body", "query", "path") or (isinstance(part, str) and _is_union_tag(part)):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def _is_union_tag(part: str) -> bool:
    return part in _PLAIN_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _validation_code(error: dict[str, Any]) -> str:
    kind = str(error.get("type", ""))
    if kind in _VALIDATION_CODES:
        return _VALIDATION_CODES[kind]
    return "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"


def body_parse_error(cause: BaseException | None) -> APIError:
    """Why a body could not be read as JSON, in words (FastAPI only says 'error parsing the body')."""
    if isinstance(cause, UnicodeDecodeError):
        where = f"byte {cause.start}: {cause.object[cause.start : cause.start + 1]!r}"
        return APIError(400, f"malformed JSON body: not valid UTF-8 at {where}", code="json_invalid")
    if isinstance(cause, RecursionError):
        return APIError(400, "malformed JSON body: nested too deeply", code="json_invalid")
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else "unreadable body"
    return APIError(400, f"malformed JSON body: {reason}", code="json_invalid")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = detail.get("ctx") or {}
            loc = tuple(detail.get("loc", ()))
            at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
            return error_response(
                400, f"malformed JSON body: {ctx.get('error', detail.get('msg'))}{at}", code="json_invalid"
            )
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            # The body as a whole is not a JSON object (no JSON content type, a list, a string, ...).
            return error_response(400, "the request body must be a JSON object", code="json_invalid")
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _loc(tuple(first.get("loc", ())))
        messages = "; ".join(f"{_loc(tuple(e.get('loc', ())))}: {e.get('msg')}" for e in errors[:5])
        return error_response(422, messages, param=param, code=_validation_code(first))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            err = body_parse_error(exc.__cause__)
            return JSONResponse(err.body(), status_code=err.status)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = to_api_error(exc)
        return JSONResponse(err.body(), status_code=err.status)


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on every HTTP request (a pure ASGI middleware, so that
    streaming responses are not buffered)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
