"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every client mistake becomes a 4xx with that body (never FastAPI's 422, never a 500); the
handlers are installed on the app by `install_error_handlers`.
"""
from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvship.core.async_engine import EngineDeadError, QueueFullError
from kvship.sampling_params import InvalidParamsError

logger = logging.getLogger("kvship.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # what OpenAI sends for a bad key (code: invalid_api_key)
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers to answer with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


RETRY_AFTER_S = 1  # what a 503 for a full queue tells clients to wait


class ServerShuttingDown(Exception):
    """Handed to in-flight requests that outlive the drain period after SIGTERM."""


def queue_full() -> APIError:
    return APIError(
        503,
        "The server is overloaded: too many requests are waiting. Retry shortly.",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def engine_error(exc: BaseException) -> APIError | None:
    """The API error for an exception raised by the engine, or None if it is not one of ours."""
    if isinstance(exc, InvalidParamsError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return queue_full()
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, "The server is shutting down; the request was aborted.", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The inference engine has stopped.", code="engine_dead")
    return None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def utf8_safe(text: str) -> str:
    """`text` with lone UTF-16 surrogates replaced by U+FFFD. JSON's "\\ud800" escapes decode to
    them and UTF-8 cannot encode them: an error message that quotes the request's own text
    (a model name, an id) must still be sendable."""
    return _LONE_SURROGATE.sub("\ufffd", text)


class SafeJSONResponse(JSONResponse):
    """The app's JSON response: whatever a body echoes back from the request, it encodes."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return utf8_safe(text).encode("utf-8")


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_response(err: APIError) -> JSONResponse:
    return SafeJSONResponse(err.body(), status_code=err.status, headers=err.headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*|[A-Z]\w*)$")

_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a list of messages",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...}); other content types are not supported',
}


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages[0].content" (union type tags dropped)."""
    parts = [p for p in loc[1:] if not (isinstance(p, str) and _TYPE_TAG.match(p))] if loc else []
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """The 400 for a list of pydantic-style errors (the first one is reported)."""
    errors = list(errors)
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
            "HTTP library correctly. The OpenAI API expects a JSON payload.)",
            code="invalid_json",
        )
    loc = tuple(first.get("loc", ()))
    if len(loc) <= 1:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    param = _param_from_loc(loc)
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    # A union reports one error per alternative: say what is accepted instead.
    field = re.sub(r"\[\d+\]$", "", param or "")
    name = re.split(r"[.\[]", field)[-1] if field else ""
    alternatives = [e for e in errors if (_param_from_loc(tuple(e.get("loc", ()))) or "").startswith(field)]
    # A value of the right type that its validator refused says more than "expected one of these types".
    refused = [e for e in alternatives if e.get("type") == "value_error"]
    if refused:
        first, param = refused[0], _param_from_loc(tuple(refused[0].get("loc", ())))
    elif name in _EXPECTED and len(alternatives) > 1:
        return bad_request(f"Invalid type for '{field}': expected {_EXPECTED[name]}.", param=field, code="invalid_type")
    msg = first.get("msg", "invalid value")
    return bad_request(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_type")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(InvalidParamsError)
    async def _invalid_params(_: Request, exc: InvalidParamsError) -> JSONResponse:
        return error_response(bad_request(str(exc), param=exc.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = "Not found."
        else:
            message = str(exc.detail) if exc.detail else HTTPStatus(status).phrase
        return SafeJSONResponse(
            error_body(message, _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")),
            status_code=status,
            headers=getattr(exc, "headers", None),
        )

    app.add_middleware(UnhandledErrorMiddleware)


class UnhandledErrorMiddleware:
    """An exception no handler answered becomes an OpenAI-shaped 500 here and goes no further.
    Starlette's own last-resort handler re-raises it after answering, and uvicorn then drops
    the keep-alive connection: the client's next request on it failed with ECONNRESET."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except ClientDisconnect:
            # The client went away before its body was read: nobody to answer, nothing broken.
            logger.info("client disconnected before sending the whole request: %s %s", scope.get("method"),
                        scope.get("path"))
        except Exception as exc:
            logger.exception("unhandled error while serving %s", scope.get("path"))
            if started:  # half a response is out: nothing valid can follow it on this connection
                raise
            body = error_body(f"Internal server error: {type(exc).__name__}", "server_error")
            await SafeJSONResponse(body, status_code=500)(scope, receive, send)
