"""The picker's OpenTelemetry span: one per pick, continuing the request's W3C `traceparent`
(or starting a trace), and handed on to the replica in the `traceparent` header it sets, so the
engine's span is the pick's child. Off (no span, the header passed on as it came) unless OTEL_*
asks for tracing (kvship.telemetry's rules)."""
from __future__ import annotations

import logging
from typing import Any

from kvship import telemetry

logger = logging.getLogger("kvship.router")

TRACE_HEADERS = ("traceparent", "tracestate")


class PickTracer:
    def __init__(self, provider: Any):
        from opentelemetry import propagate

        self.provider = provider
        self.tracer = provider.get_tracer("kvship.router")
        self.propagator = propagate.get_global_textmap()

    @classmethod
    def from_env(cls) -> "PickTracer | None":
        try:
            provider = telemetry.provider_from_env("kvship-router")
        except Exception:  # noqa: BLE001 - bad tracing settings must not stop routing
            logger.exception("could not set up tracing from OTEL_* settings; tracing is off")
            return None
        return cls(provider) if provider is not None else None

    def start(self, headers: dict[str, str]) -> Any:
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span("kvship.router pick", context=self.propagator.extract(headers),
                                      kind=SpanKind.SERVER,
                                      attributes={"url.path": headers.get(":path", ""),
                                                  "http.request.method": headers.get(":method", "")})

    def headers_for(self, span: Any) -> dict[str, str]:
        """The trace headers that make `span` the upstream request's parent."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return {k: v for k, v in carrier.items() if k in TRACE_HEADERS}

    def shutdown(self) -> None:
        self.provider.shutdown()
