"""OpenTelemetry traces for the server, configured by the standard OTEL_* environment variables.

When tracing is on and how it exports: ``kvship.telemetry`` (the one place for the OTEL_*
rules, shared with the operator); service.name defaults to `kvship`. Otherwise nothing is
installed: no middleware, no per-request work.

Each app gets its own tracer provider (`build_app(..., tracer_provider=...)` lets a caller,
e.g. a test, pass one); the global provider is never set. Per OpenAI request there is one
SERVER span, continuing an incoming `traceparent`, named `{gen_ai.operation.name} {model}` and
carrying GenAI semantic-convention attributes, with events `queued`, `scheduled` (prefill
starts), `first_token` and `finished` (or `aborted`) stamped with the engine's own times.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

import kvship
from kvship import telemetry
from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams

logger = logging.getLogger("kvship.server")

# Routes that get a span, and their gen_ai.operation.name.
TRACED_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
SPAN_SCOPE_KEY = "kvship.span"  # where the middleware leaves the span in the ASGI scope


def provider_from_env(env: Mapping[str, str] | None = None) -> Any | None:
    """The server's TracerProvider from OTEL_*, or None when tracing is off."""
    # shutdown_on_exit=False: the app shuts it down (off the event loop) when it stops.
    return telemetry.provider_from_env("kvship", env, attributes={"service.version": kvship.__version__},
                                       shutdown_on_exit=False)


class ServerTracing:
    """A tracer from one app's provider, and the propagator for incoming context."""

    def __init__(self, provider: Any, *, owned: bool):
        from opentelemetry import propagate

        self.provider = provider
        self.tracer = provider.get_tracer("kvship.server", kvship.__version__)
        self.propagator = propagate.get_global_textmap()  # honours OTEL_PROPAGATORS
        self._owned = owned

    @classmethod
    def create(cls, tracer_provider: Any | None = None) -> "ServerTracing | None":
        if tracer_provider is not None:
            return cls(tracer_provider, owned=False)
        try:
            provider = provider_from_env()
        except Exception:  # noqa: BLE001 - bad tracing settings must not stop serving
            logger.exception("could not set up tracing from OTEL_* settings; tracing is off")
            return None
        if provider is None:
            return None
        logger.info("OpenTelemetry tracing on")
        return cls(provider, owned=True)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Flush and stop the provider if this app made it (in a thread: an unreachable
        collector must not block the event loop)."""
        if not self._owned:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.provider.shutdown), timeout)
        except Exception:
            logger.warning("trace exporter did not shut down cleanly", exc_info=True)


class TracingMiddleware:
    """Opens the SERVER span of each traced OpenAI request before the body is read and ends it
    after the last byte of the response (streams included)."""

    def __init__(self, app: ASGIApp, tracing: ServerTracing):
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = TRACED_ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if operation is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self.tracing.propagator.extract(carrier)
        model = _model_name(scope)
        span = self.tracing.tracer.start_span(
            f"{operation} {model}" if model else operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "kvship",
                "http.request.method": "POST",
                "http.route": scope["path"],
                "url.path": scope["path"],
            },
        )
        scope[SPAN_SCOPE_KEY] = span
        status: list[int] = []

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                span.set_attribute("http.response.status_code", message["status"])
            await send(message)

        try:
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                await self.app(scope, receive, send_wrapper)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.set_attribute("error.type", type(exc).__qualname__)
            raise
        else:
            if status and status[0] >= 500:
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(status[0]))
        finally:
            span.end()


def _model_name(scope: dict) -> str | None:
    app = scope.get("app")
    state = getattr(getattr(app, "state", None), "kvship", None)
    try:
        return state.model_name if state is not None else None
    except Exception:
        return None


def request_span(request: Request) -> Any | None:
    """The span the middleware opened for this request (None when tracing is off)."""
    return request.scope.get(SPAN_SCOPE_KEY)


# ------------------------------------------------------------ what the observer writes


def set_request_attributes(span: Any, *, model: str, request_id: str, params: SamplingParams) -> None:
    attrs: dict[str, Any] = {
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.n != 1:
        attrs["gen_ai.request.choice.count"] = int(params.n)
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = int(params.seed)
    if params.top_k is not None and params.top_k > 0:
        attrs["gen_ai.request.top_k"] = float(params.top_k)
    if params.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = float(params.presence_penalty)
    if params.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = float(params.frequency_penalty)
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop)
    span.set_attributes(attrs)


class WallClock:
    """Maps time.monotonic() readings (the engine's timestamps) to epoch nanoseconds."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def __call__(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns


def add_lifecycle_events(span: Any, out: RequestOutput | None, clock: WallClock, *, prompt_index: int | None,
                         aborted: bool = False) -> None:
    """`queued`, `scheduled`, `first_token`, then `finished` (or `aborted`), as far as `out`
    (the request's last RequestOutput, or None) knows them."""
    base: dict[str, Any] = {}
    if prompt_index is not None:
        base["kvship.prompt_index"] = prompt_index
    if out is not None:
        base["kvship.request_id"] = out.request_id
        span.add_event("queued", dict(base), timestamp=clock(out.arrival_time))
        if out.first_scheduled_time is not None:
            span.add_event("scheduled", {**base, "kvship.num_cached_tokens": int(out.num_cached_tokens)},
                           timestamp=clock(out.first_scheduled_time))
        if out.first_token_time is not None:
            span.add_event("first_token", dict(base), timestamp=clock(out.first_token_time))
    if aborted:
        span.add_event("aborted", dict(base))
    elif out is not None:
        reasons = [c.finish_reason or "stop" for c in sorted(out.outputs, key=lambda c: c.index)]
        done = out.finished_time if out.finished_time is not None else time.monotonic()
        span.add_event(
            "finished",
            {**base, "gen_ai.response.finish_reasons": reasons,
             "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in out.outputs)},
            timestamp=clock(done),
        )


def set_usage(span: Any, lasts: list[RequestOutput | None]) -> None:
    """Usage and finish reasons over all of the request's prompts, plus engine latencies."""
    outs = [o for o in lasts if o is not None]
    input_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    reasons = [c.finish_reason or "abort" for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    attrs: dict[str, Any] = {
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.response.finish_reasons": reasons,
        "kvship.usage.cached_input_tokens": sum(o.num_cached_tokens for o in outs),
    }
    if len(outs) == 1:
        o = outs[0]
        if o.first_scheduled_time is not None:
            attrs["kvship.latency.time_in_queue"] = o.first_scheduled_time - o.arrival_time
        if o.first_token_time is not None:
            attrs["kvship.latency.time_to_first_token"] = o.first_token_time - o.arrival_time
        if o.finished_time is not None:
            attrs["kvship.latency.e2e"] = o.finished_time - o.arrival_time
    span.set_attributes(attrs)
