"""Envoy + the picker with no engine running: a request is held (the picker shows the demand)
until a real `kvship serve` started afterwards is ready, then answered by it; both processes
export traces over OTLP, and the engine's span is the child of the picker's span, itself the
child of the client's traceparent."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from otlp_utils import OTLPReceiver
from router_utils import RouterProcess
from server_utils import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)  # an engine starts inside the test

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def test_request_held_at_zero_is_answered_by_an_engine_started_late_and_traced():
    receiver = OTLPReceiver()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    port = free_port()
    router = RouterProcess([f"http://127.0.0.1:{port}"], "prefix", "--scrape-interval", "0.2",
                           "--hold-timeout", "150", env=otel)
    engine = None
    answers: list[httpx.Response] = []
    try:
        router.wait_started()
        asking = threading.Thread(target=lambda: answers.append(httpx.post(
            router.url + "/v1/chat/completions", timeout=170,
            headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
            json={"model": "any", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello!"}]})))
        asking.start()
        deadline = time.monotonic() + 30
        while router.metric("kvship_router:pending_requests") != 1.0:
            assert time.monotonic() < deadline and not answers, (answers, router.picker_metrics())
            time.sleep(0.1)

        engine = ServerProcess("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "1",
                               "--served-model-name", "any", port=port, env=otel)
        asking.join(170)
        assert answers and answers[0].status_code == 200, (answers and answers[0].text, engine.log())
        assert answers[0].headers["x-kvship-endpoint"] == f"127.0.0.1:{port}"
        assert answers[0].json()["choices"][0]["message"]["content"]
        assert router.metric("kvship_router:pending_requests") == 0.0

        spans = {s["name"]: s for s in receiver.wait_for(2)}
        pick, served = spans["kvship.router pick"], spans["chat any"]
        assert pick["resource"]["service.name"] == "kvship-router"
        assert pick["trace_id"] == served["trace_id"] == TRACE_ID
        assert pick["parent_span_id"] == CLIENT_SPAN_ID
        assert served["parent_span_id"] == pick["span_id"]  # the engine's span is the pick's child
        assert pick["attributes"]["kvship.router.endpoint"] == f"127.0.0.1:{port}"
    finally:
        code = router.stop()
        if engine is not None:
            engine.stop(15)
        receiver.close()
    assert code == 0, router.log()
