"""Scale from zero and back (issue 51): the decisions, the router's signal as kvship's router
exposes it, and the KEDA query that carries it."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest

from kvship_operator import autoscaler as asc
from kvship_operator import builders as b
from kvship_operator import scale_zero as sz
from kvship_operator import spec as s
from kvship_operator.schema import parse

IDLE = 60.0


def test_router_exposition_parsed():
    pytest.importorskip("grpc")
    from kvship.router.pool import Pool
    from kvship.router.stats import RouterStats

    stats = RouterStats(Pool([], "prefix"))
    for reason in ("no-endpoint", "no-endpoint", "hold-timeout", "hold-full"):
        stats.picked(reason, None)
    stats.picked("prefix-hit", "10.0.0.1:8000")
    text = generate_latest(stats.registry).decode()
    assert f"{b.ROUTER_PENDING_METRIC} 0.0" in text  # the router's own name for what it holds
    assert sz.parse_router(text) == sz.RouterSignal(pending=0.0, refused=4.0)
    held = text.replace(f"{b.ROUTER_PENDING_METRIC} 0.0", f"{b.ROUTER_PENDING_METRIC} 3.0")
    assert sz.parse_router(held) == sz.RouterSignal(pending=3.0, refused=4.0)


def test_zero_replicas_wait_for_demand():
    state = asc.Autoscaler()
    idle = sz.decide(state, 0.0, 0, None, sz.RouterSignal(0, 5), IDLE)
    assert (idle.replicas, idle.reason, idle.changed) == (0, "Idle", False)
    # refusals counted before the operator looked are a baseline, not demand
    assert sz.decide(state, 1.0, 0, None, sz.RouterSignal(0, 5), IDLE).reason == "Idle"
    up = sz.decide(state, 2.0, 0, None, sz.RouterSignal(0, 6), IDLE)
    assert (up.replicas, up.reason, up.changed) == (1, "ScaleFromZero", True) and "refused" in up.message
    held = sz.decide(asc.Autoscaler(), 0.0, 0, None, sz.RouterSignal(2, 0), IDLE)
    assert (held.replicas, held.reason) == (1, "ScaleFromZero") and "2 request(s) held" in held.message
    # no router answering: nothing to go on, stay at zero
    assert sz.decide(asc.Autoscaler(), 0.0, 0, None, None, IDLE).replicas == 0


def test_back_to_zero_after_the_idle_window_only():
    state = asc.Autoscaler()
    quiet = sz.RouterSignal(0, 0)
    assert sz.decide(state, 0.0, 2, 0.0, quiet, IDLE) is None  # the window starts when first seen
    assert sz.decide(state, 30.0, 2, 3.0, quiet, IDLE) is None  # busy: the window starts again
    assert sz.decide(state, 80.0, 2, 0.0, quiet, IDLE) is None  # 50 s idle
    assert sz.decide(state, 85.0, 2, None, quiet, IDLE) is None  # no metrics (starting): counted as busy
    assert sz.decide(state, 140.0, 2, 0.0, quiet, IDLE) is None
    down = sz.decide(state, 145.0, 2, 0.0, quiet, IDLE)
    assert (down.replicas, down.reason, down.changed) == (0, "ScaleToZero", True)
    # requests held by the router while a replica runs keep it
    state = asc.Autoscaler()
    sz.decide(state, 0.0, 1, 0.0, quiet, IDLE)
    assert sz.decide(state, 100.0, 1, 0.0, sz.RouterSignal(1, 0), IDLE) is None
    assert sz.decide(state, 150.0, 1, 0.0, quiet, IDLE) is None


class RouterPage:
    """A real HTTP server answering /metrics with the text last set."""

    def __init__(self, text: str):
        page = self
        self.set(text)

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = page.body
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def set(self, text: str) -> None:
        self.body = text.encode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _pod(name: str, ready: bool) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_read_routers_sums_the_ready_pods_that_answer():
    pages = [RouterPage(f"{b.ROUTER_PENDING_METRIC} 2\n"),
             RouterPage('kvship_router:picks_total{endpoint="",reason="no-endpoint"} 4.0\n')]
    try:
        where = {"r0": pages[0].address, "r1": pages[1].address, "r2": "127.0.0.1:1", "r3": pages[0].address}
        pods = [_pod("r0", True), _pod("r1", True), _pod("r2", True), _pod("r3", False)]
        signal = sz.read_routers(pods, lambda p: where[p["metadata"]["name"]], timeout=2)
        assert signal == sz.RouterSignal(pending=2.0, refused=4.0)  # r2 does not answer, r3 is not ready
        assert sz.read_routers([_pod("r2", True)], lambda p: "127.0.0.1:1", timeout=2) is None
    finally:
        for p in pages:
            p.close()


def test_keda_query_counts_what_the_router_holds():
    owner = b.Owner("qwen", "team-a", "u")
    auto = {"enabled": True, "provider": "keda", "minReplicas": 0, "maxReplicas": 2,
            "prometheusServerAddress": "http://prom:9090"}
    routed = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "replicas": 0, "routing": {"mode": "envoy"},
                                         "autoscaling": auto})
    so = b.scaled_object(owner, routed)
    assert so["spec"]["minReplicaCount"] == 0
    assert f'{b.ROUTER_PENDING_METRIC}{{namespace="team-a",pod=~"qwen-router-.+"}}' in so["spec"]["triggers"][0][
        "metadata"]["query"]
    plain = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}})
    assert b.ROUTER_PENDING_METRIC not in b.keda_query(owner, plain)
