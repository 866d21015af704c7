"""GET /metrics: Prometheus text, read from `engine.stats()` at scrape time.

Each app has its own CollectorRegistry (several apps, e.g. in tests, never collide); more
collectors can be registered on `app.state.kvship_metrics.registry`.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

router = APIRouter()


class EngineStatsCollector(Collector):
    """Gauges and counters from the engine's own counters (names follow vLLM's, prefixed kvship:)."""

    def __init__(self, state: Any):
        self._state = state  # ServerState: the engine may be attached after the app is built

    def collect(self) -> Iterator[Metric]:
        engine = self._state.engine
        if engine is None:
            return
        s = engine.stats()
        labels = ["model_name"]
        values = [self._state.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        total = s.num_kv_blocks_total or 0
        yield gauge("kvship:num_requests_running", "Requests in the running batch.", s.num_requests_running)
        yield gauge("kvship:num_requests_waiting", "Requests waiting to be scheduled.", s.num_requests_waiting)
        yield gauge(
            "kvship:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            (s.num_kv_blocks_used / total) if total else 0.0,
        )
        yield gauge("kvship:num_kv_blocks_total", "KV-cache blocks allocated.", total)
        yield gauge("kvship:num_kv_blocks_used", "KV-cache blocks held by requests.", s.num_kv_blocks_used)
        yield gauge("kvship:num_kv_blocks_free", "KV-cache blocks free (cached prefixes included).", s.num_kv_blocks_free)
        yield counter("kvship:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("kvship:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("kvship:num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions)
        yield counter("kvship:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield counter("kvship:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield gauge("kvship:engine_alive", "1 while the engine's step loop runs.", 1.0 if engine.is_alive() else 0.0)


class ServerMetrics:
    def __init__(self, state: Any):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    m: ServerMetrics = request.app.state.kvship_metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
