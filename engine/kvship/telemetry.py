"""OpenTelemetry set-up from the standard OTEL_* environment variables, shared by the server and
the operator (it imports nothing heavier than the OpenTelemetry SDK, and only when asked).

Tracing is on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_TRACES_EXPORTER is set, unless OTEL_SDK_DISABLED is true or OTEL_TRACES_EXPORTER is
`none`. Exporters: `otlp` (HTTP/protobuf) and `console`. The global provider is never set.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("kvship.telemetry")


def tracing_requested(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    return bool(exporters or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def provider_from_env(service_name: str, env: Mapping[str, str] | None = None, *,
                      attributes: Mapping[str, str] | None = None, shutdown_on_exit: bool = True) -> Any | None:
    """A TracerProvider configured from OTEL_* (batching span processors, exporters chosen by
    OTEL_TRACES_EXPORTER, default `otlp`; service.name defaults to `service_name`), or None
    when tracing is not asked for."""
    env = os.environ if env is None else env
    if not tracing_requested(env):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporters = []
    for name in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        name = name.strip().lower()
        if name in ("otlp", "otlp_proto_http"):
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
            if protocol != "http/protobuf":
                logger.warning("OTLP protocol %r is not available; exporting traces over http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name and name != "none":
            logger.warning("unknown trace exporter %r in OTEL_TRACES_EXPORTER; ignored", name)
    if not exporters:
        return None
    resource = Resource.create(dict(attributes or {}))
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=shutdown_on_exit)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
