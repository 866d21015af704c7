"""The picker's own HTTP port: /health (200 while an endpoint is healthy, else 503) and /metrics
(picks by reason and endpoint, each endpoint's health and load as the picker sees it, requests
held for want of a ready endpoint: the demand that scales from zero)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from kvship.router.hold import Holding
from kvship.router.pool import Pool


class RouterStats:
    def __init__(self, pool: Pool, holding: Holding | None = None):
        self.pool = pool
        self.registry = CollectorRegistry()
        self.picks = Counter("kvship_router:picks", "Requests routed, by reason and chosen endpoint.",
                             ["reason", "endpoint"], registry=self.registry)
        self.registry.register(_PoolCollector(pool, holding))

    def picked(self, reason: str, endpoint: str | None) -> None:
        self.picks.labels(reason=reason, endpoint=endpoint or "").inc()


class _PoolCollector:
    def __init__(self, pool: Pool, holding: Holding | None):
        self.pool = pool
        self.holding = holding

    def collect(self):
        healthy = GaugeMetricFamily("kvship_router:endpoint_healthy", "1 while the endpoint's /metrics answers.",
                                    labels=["endpoint"])
        load = GaugeMetricFamily("kvship_router:endpoint_load",
                                 "Picks in flight + requests waiting at the last scrape.", labels=["endpoint"])
        in_flight = GaugeMetricFamily("kvship_router:endpoint_in_flight", "Picks whose request has not ended.",
                                      labels=["endpoint"])
        cached = GaugeMetricFamily("kvship_router:endpoint_cached_blocks",
                                   "KV-cache blocks the endpoint's engine reports holding (its KV-cache events).",
                                   labels=["endpoint"])
        with self.pool.lock:
            for e in self.pool.endpoints:
                healthy.add_metric([e.address], 1.0 if e.healthy else 0.0)
                load.add_metric([e.address], e.load)
                in_flight.add_metric([e.address], e.in_flight)
                if self.pool.cached is not None:
                    cached.add_metric([e.address], self.pool.cached.count(e.address))
            pending = self.holding.pending if self.holding else 0
        yield healthy
        yield load
        yield in_flight
        if self.pool.cached is not None:
            yield cached
        yield GaugeMetricFamily("kvship_router:pending_requests",
                                "Requests held until an endpoint is ready (scale from zero).", value=pending)


class StatsServer:
    def __init__(self, stats: RouterStats, host: str, port: int):
        stats_ref = stats

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == "/health":
                    ok = bool(stats_ref.pool.healthy())
                    self._send(200 if ok else 503, b'{"status":"ok"}' if ok else b'{"status":"no healthy endpoint"}',
                               "application/json")
                elif self.path == "/metrics":
                    self._send(200, generate_latest(stats_ref.registry), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"error":"not found"}', "application/json")

            def _send(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="kvship-router-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)
