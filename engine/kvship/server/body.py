"""The request body as a pydantic model, and the checks every generating endpoint starts with
(the model's name, the engine being there to serve)."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvship.server.engine_client import EngineClient
from kvship.server.errors import APIError, bad_request, utf8_safe, validation_error
from kvship.server.state import ServerState

# Parsing and validating a body takes about 10 ms per MB, longer for long lists of token ids:
# larger ones are parsed in a worker thread so that the event loop keeps serving meanwhile.
OFFLOAD_BYTES = 1 << 20

M = TypeVar("M", bound=BaseModel)


async def accept(raw_request: Request, model: type[M], task: str = "generate"
                 ) -> tuple[M, ServerState, EngineClient]:
    """The parsed body, the server state and the engine, for an endpoint that uses the model
    for `task` (404 for another model's name, 503 while the engine is not serving, 400 when the
    model is served for the other task)."""
    state: ServerState = raw_request.app.state.kvship
    body = await parse_body(raw_request, model, state.max_body_bytes)
    state.check_model(getattr(body, "model", None))
    engine = state.engine_for(getattr(body, "model", None))
    if engine.task != task:
        raise bad_request(f"The model `{engine.model_name}` is served for {_TASK_NAMES[engine.task]}, not for "
                          f"{_TASK_NAMES[task]} (kvship serve --task).", param="model", code="wrong_task")
    return body, state, engine


_TASK_NAMES = {"generate": "completions and chat (/v1/completions, /v1/chat/completions)",
               "embed": "embeddings (/v1/embeddings)"}


async def parse_body(request: Request, model: type[M], limit: int | None = None) -> M:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form encoding);
    malformed JSON and wrong types become OpenAI-shaped 400s, a body over `limit` bytes a 413."""
    raw = await read_body(request, limit)
    if len(raw) > OFFLOAD_BYTES:
        state: ServerState = request.app.state.kvship
        async with state.large_body_slots:  # a burst of large bodies is parsed a few at a time
            return await asyncio.to_thread(_decode, raw, model)
    return _decode(raw, model)


def _too_large(limit: int) -> APIError:
    # The rest of the body is not read: the connection cannot carry another request after it.
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(kvship serve --max-request-body-size).", code="request_too_large",
                    headers={"Connection": "close"})


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit`: from Content-Length
    before reading anything, else while it streams in."""
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(raw: bytes, model: type[M]) -> M:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise validation_error([{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON"}]) from None
    except RecursionError:  # json's decoder stops at the interpreter's recursion limit
        raise bad_request("The JSON body is nested too deeply.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    if b"\x00" in raw[:4] or _SURROGATE_ESCAPE.search(raw):  # (a UTF-16 or -32 body: searched whole)
        _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [dict(e, loc=("body", *e.get("loc", ()))) for e in exc.errors()]
        raise validation_error(errors) from None


# A lone UTF-16 surrogate can only come in as a JSON escape (json.loads refuses one in raw
# UTF-8), so a UTF-8 body is searched only when its raw bytes hold such an escape.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """A 400 naming the first field (of any kind, known or not) whose text holds a lone
    surrogate: such text is not Unicode, so it can be neither tokenised nor sent back as UTF-8."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                param = path or "body"
                raise bad_request(f"Invalid value for '{param}': the text contains a lone UTF-16 surrogate "
                                  f"(\\u{ord(found.group()):04x}) at position {found.start()}, which is not valid "
                                  "Unicode.", param=param, code="invalid_value")
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                name = f"{path}.{utf8_safe(key)}" if path else utf8_safe(key)
                if _SURROGATE.search(key):
                    stack.append((name, key))
                else:
                    stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
