"""OpenTelemetry traces for the operator: one span per reconcile (and per autoscaler
decision that changes replicas), configured by the standard OTEL_* environment variables.

When tracing is on and how it exports: ``kvship.telemetry`` (the one place for the OTEL_*
rules, shared with the engine's server); otherwise ``span()`` is a no-op. service.name
defaults to `kvship-operator`. The global tracer provider is never set; tests pass their own
provider to ``configure``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from kvship import telemetry

logger = logging.getLogger("kvship_operator.tracing")

SERVICE_NAME = "kvship-operator"
_lock = threading.Lock()
_state: dict[str, Any] = {"configured": False, "provider": None, "tracer": None, "owned": False}


def provider_from_env(env: Mapping[str, str] | None = None) -> Any | None:
    """The operator's TracerProvider from OTEL_*, or None when tracing is off."""
    return telemetry.provider_from_env(SERVICE_NAME, env)


def configure(provider: Any | None = None) -> None:
    """Use ``provider`` (tests), or build one from the environment (once; None: off)."""
    with _lock:
        owned = provider is None
        if owned:
            try:
                provider = provider_from_env()
            except Exception:  # noqa: BLE001 - bad tracing settings must not stop the operator
                logger.exception("could not set up tracing from OTEL_* settings; tracing is off")
                provider = None
        _state.update(configured=True, provider=provider, owned=owned and provider is not None,
                      tracer=provider.get_tracer("kvship.operator") if provider is not None else None)
        if provider is not None:
            logger.info("OpenTelemetry tracing on")


def shutdown() -> None:
    with _lock:
        provider, owned = _state["provider"], _state["owned"]
        _state.update(configured=False, provider=None, tracer=None, owned=False)
    if provider is not None and owned:
        try:
            provider.shutdown()
        except Exception:
            logger.warning("trace exporter did not shut down cleanly", exc_info=True)


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any | None]:
    """A span named ``name`` (None when tracing is off). An exception escaping the block is
    recorded and sets the span's status to ERROR."""
    if not _state["configured"]:
        configure()
    tracer = _state["tracer"]
    if tracer is None:
        yield None
        return
    with tracer.start_as_current_span(name, attributes=dict(attributes or {})) as sp:
        yield sp


def reconcile_attributes(kind: str, namespace: str, name: str, generation: int | None, cause: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "k8s.namespace.name": namespace,
        "kvship.resource.kind": kind,
        "kvship.resource.name": name,
        "kvship.reconcile.cause": cause,
    }
    if generation is not None:
        attrs["kvship.resource.generation"] = int(generation)
    return attrs
