"""/openapi.json as the API really is: the handlers read their bodies themselves (so that every
mistake becomes an OpenAI-shaped 400, never FastAPI's 422), which leaves FastAPI's generated
document without request bodies and with 200 as the only answer. The request models and the
error responses are added here, so that schema-driven clients and fuzzers see what is served."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from kvship.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorDetail


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

_ERRORS = {
    "400": "Invalid request: the `param` field names what is wrong.",
    "401": "Missing or wrong API key (only when the server has one).",
    "404": "Unknown model.",
    "413": "The body is larger than the server's limit.",
    "503": "Loading, shutting down, or the queue is full (see Retry-After).",
}
ErrorStatus = Literal["400", "401", "404", "413", "503"]


def _error(status: str) -> dict[str, Any]:
    return {"description": _ERRORS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def install_openapi(app: FastAPI, *, api_key: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorResponse, *REQUEST_BODIES.values()):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[model.__name__] = js
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                op.get("responses", {}).pop("422", None)  # FastAPI's own validation answer is never sent
                statuses: list[ErrorStatus] = []
                model = REQUEST_BODIES.get(path) if method == "post" else None
                if model is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                    statuses += ["400", "404", "413", "503"]
                elif path.startswith("/v1/models/"):
                    statuses += ["404"]
                if api_key and path.startswith(("/v1", "/tokenize", "/detokenize")):
                    statuses.append("401")
                for status in statuses:
                    op.setdefault("responses", {})[status] = _error(status)
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace it
