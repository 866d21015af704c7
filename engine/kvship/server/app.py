"""The FastAPI application: OpenAI routes, /health, /version, /metrics, /v1/models.

`build_app(engine, config)` keeps all state on `app.state` (no module globals), so several apps
can live in one process. The engine is owned by the caller (the CLI starts and stops it).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

import kvship
from kvship.config import EngineConfig
from kvship.server.chat import router as chat_router
from kvship.server.chat_page import mount_chat_page
from kvship.server.completions import router as completions_router
from kvship.server.embeddings import router as embeddings_router
from kvship.server.engine_client import EngineClient
from kvship.server.errors import SafeJSONResponse, error_body, install_error_handlers
from kvship.server.lora import adapter_cards
from kvship.server.lora import router as lora_router
from kvship.server.memory import MemoryTrimmer, TrimAfterLargeRequests
from kvship.server.metrics import ServerMetrics
from kvship.server.metrics import router as metrics_router
from kvship.server.openapi import install_openapi
from kvship.server.responses_api import router as responses_router
from kvship.server.state import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_RESPONSES_STORE_BYTES,
    ServerState,
)
from kvship.server.timeouts import DEFAULT_BODY_TIMEOUT_S, BodyTimeoutMiddleware
from kvship.server.tokenize import router as tokenize_router
from kvship.server.tool_prompt import tool_format
from kvship.server.tracing import ServerTracing, TracingMiddleware

logger = logging.getLogger("kvship.server")


PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on the API (/v1/*, /tokenize, /detokenize); health,
    version and metrics stay open (probes and scrapers carry no key). Checked before the body
    is read."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                supplied = value
                break
        # The scheme name is case-insensitive (RFC 9110 11.1): "bearer KEY" is as good as "Bearer KEY".
        scheme, _, token = supplied.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            await self.app(scope, receive, send)
            return
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            if not supplied
            else "Incorrect API key provided."
        )
        response = SafeJSONResponse(
            error_body(message, "invalid_request_error", None, "invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def build_app(engine: EngineClient | None, config: EngineConfig | None, api_key: str | None = None, *, chat_page: bool = True,
              tracer_provider: Any | None = None,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
              allow_runtime_lora_updating: bool = False) -> FastAPI:
    """An app serving `engine` (an AsyncEngine, or None while it loads: then everything but
    /health, /version and /metrics answers 503). Traces go to `tracer_provider` when given,
    else to one built from the OTEL_* environment (none when those are unset). A request body
    must arrive within `body_timeout_s` of its headers (408 otherwise). Stored /v1/responses
    conversations are kept up to `responses_store_bytes` of text."""
    if engine is not None:
        _ = engine.tokenizer.max_token_chars  # computed once, here, not inside the first request
        if engine.task == "generate":  # the tool-call format, chosen and logged at start-up
            tool_format(engine.tokenizer, tool_call_parser)
    state = ServerState(engine, config, api_key, max_prompts_per_request=max_prompts_per_request,
                        max_body_bytes=max_body_bytes, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, responses_store_bytes=responses_store_bytes,
                        allow_runtime_lora_updating=allow_runtime_lora_updating)
    tracing = ServerTracing.create(tracer_provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Shutdown: stop reporting ready. In-flight requests were drained (or cancelled, which
        # aborts them in the engine) by the server before this runs.
        state.draining = True
        if tracing is not None:
            await tracing.shutdown()

    app = FastAPI(title="kvship", version=kvship.__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  default_response_class=SafeJSONResponse)
    app.state.kvship = state
    app.state.kvship_metrics = ServerMetrics(state)
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        s: ServerState = request.app.state.kvship
        if s.ready:
            return SafeJSONResponse({"status": "ok"})
        reason = (
            "loading" if s.engine is None else "shutting_down" if s.draining else "engine_dead"
        )
        return SafeJSONResponse({"status": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvship.__version__}

    def model_card(s: ServerState) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": s.model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "kvship",
            "root": (s.config.model if s.config is not None and s.config.model else s.model_name),
            "parent": None,
        }
        if s.engine is not None:
            card["max_model_len"] = s.engine.max_model_len
            if s.engine.task == "generate":
                card["tool_calling"] = tool_format(s.engine.tokenizer, s.tool_call_parser).card()
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        s: ServerState = request.app.state.kvship
        return {"object": "list", "data": [model_card(s), *adapter_cards(s.loras, s.model_name, s.created)]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes (hub names: org/model)
    async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
        s: ServerState = request.app.state.kvship
        s.check_model(model_id)
        adapter = [c for c in adapter_cards(s.loras, s.model_name, s.created) if c["id"] == model_id]
        return adapter[0] if adapter and model_id != s.model_name else model_card(s)

    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(embeddings_router)
    app.include_router(responses_router)
    app.include_router(metrics_router)
    app.include_router(tokenize_router)
    app.include_router(lora_router)

    app.add_middleware(BodyTimeoutMiddleware, timeout_s=body_timeout_s)
    app.state.kvship_trimmer = MemoryTrimmer()
    app.add_middleware(TrimAfterLargeRequests, trimmer=app.state.kvship_trimmer)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.kvship_tracing = tracing
    if tracing is not None:  # outermost: refused requests (401) get a span too
        app.add_middleware(TracingMiddleware, tracing=tracing)

    mount_chat_page(app, chat_page)
    install_openapi(app, api_key=bool(api_key))
    return app


async def drain(state: ServerState, grace_s: float) -> None:
    """The server's part of a graceful stop (SIGTERM): it keeps listening while /health answers
    503 (load balancers and Kubernetes stop sending) and new work is refused with a 503; the
    requests in flight get up to `grace_s` seconds to finish, then the rest are ended
    (ServerState.end_all). Returns once nothing is in flight, or a few seconds after that cut."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, grace_s)
    while state.active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.active:
        n = state.end_all()
        logger.warning("ended %d request(s) still running at the end of the drain period (aborted)", n)
        deadline = loop.time() + 5.0  # their last chunks and [DONE] go out
        while state.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
