"""The FastAPI application: OpenAI routes, /health, /version, /metrics, /v1/models.

`build_app(engine, config)` keeps all state on `app.state` (no module globals), so several apps
can live in one process. The engine is owned by the caller (the CLI starts and stops it).
"""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import kvship
from kvship.server.chat import router as chat_router
from kvship.server.completions import router as completions_router
from kvship.server.errors import error_body, install_error_handlers
from kvship.server.metrics import ServerMetrics
from kvship.server.metrics import router as metrics_router
from kvship.server.tokenize import router as tokenize_router
from kvship.server.serving import ServerState
from kvship.server.tracing import ServerTracing, TracingMiddleware

logger = logging.getLogger("kvship.server")


PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` on the API (/v1/*, /tokenize, /detokenize); health,
    version and metrics stay open (probes and scrapers carry no key). Checked before the body
    is read."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._key = ("Bearer " + api_key).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES) or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        supplied = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                supplied = value
                break
        if hmac.compare_digest(supplied, self._key):
            await self.app(scope, receive, send)
            return
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            if not supplied
            else "Incorrect API key provided."
        )
        response = JSONResponse(
            error_body(message, "invalid_request_error", None, "invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)


def build_app(engine: Any, config: Any, api_key: str | None = None, *, chat_page: bool = True,
              tracer_provider: Any | None = None) -> FastAPI:
    """An app serving `engine` (an AsyncEngine, or None while it loads: then everything but
    /health, /version and /metrics answers 503). Traces go to `tracer_provider` when given,
    else to one built from the OTEL_* environment (none when those are unset)."""
    state = ServerState(engine, config, api_key)
    tracing = ServerTracing.create(tracer_provider)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # Shutdown: stop reporting ready. In-flight requests were drained (or cancelled, which
        # aborts them in the engine) by the server before this runs.
        state.draining = True
        if tracing is not None:
            await tracing.shutdown()

    app = FastAPI(title="kvship", version=kvship.__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.kvship = state
    app.state.kvship_metrics = ServerMetrics(state)
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        s: ServerState = request.app.state.kvship
        if s.ready:
            return JSONResponse({"status": "ok"})
        reason = (
            "loading" if s.engine is None else "shutting_down" if s.draining else "engine_dead"
        )
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvship.__version__}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        s: ServerState = request.app.state.kvship
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
        return {"object": "list", "data": [card]}

    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(metrics_router)
    app.include_router(tokenize_router)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.kvship_tracing = tracing
    if tracing is not None:  # outermost: refused requests (401) get a span too
        app.add_middleware(TracingMiddleware, tracing=tracing)

    try:
        from kvship.server.chat_page import mount_chat_page
    except ImportError:
        pass
    else:
        mount_chat_page(app, chat_page)
    return app


def begin_drain(app: FastAPI, grace_s: float) -> None:
    """Stop reporting ready and refuse new work; requests still running after `grace_s`
    seconds are aborted (503 / an error event in their stream). Call it on the event loop."""
    import asyncio

    state: ServerState = app.state.kvship
    state.draining = True
    if state.drain_scheduled:
        return
    state.drain_scheduled = True

    def interrupt() -> None:
        n = state.interrupt_all()
        if n:
            logger.warning("aborted %d request(s) still running at the end of the drain period", n)

    asyncio.get_running_loop().call_later(max(0.0, grace_s), interrupt)


def attach_engine(app: FastAPI, engine: Any) -> None:
    """Hand a (now loaded) engine to an app built with engine=None."""
    app.state.kvship.engine = engine

