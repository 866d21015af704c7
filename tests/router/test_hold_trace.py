"""The picker at zero ready endpoints (a request held until one turns healthy, or answered 503 +
Retry-After when the wait or the queue runs out, demand shown while it waits) and its span (one
per pick, continuing the request's traceparent and handed on to the replica as its parent)."""
from __future__ import annotations

import json
import shlex
import sys
import threading
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import picker_utils
from kvship.router.hold import Holding, demand_command
from kvship.router.tracing import PickTracer
from picker_utils import TRACEPARENT, chat, picked, set_headers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def picker_factory():
    yield from picker_utils.picker_factory()


def held_picker(picker_factory, timeout_s: float, max_pending: int = 8, on_demand=None):
    p = picker_factory(addresses=["127.0.0.1:18001"])
    p.holding.timeout_s, p.holding.max_pending, p.holding.on_demand = timeout_s, max_pending, on_demand
    p.pool.update(p.pool.endpoints[0], None)  # its /metrics did not answer: nothing is ready
    return p


def wait_pending(holding: Holding, n: int) -> None:
    deadline = time.monotonic() + 10
    while holding.pending != n:
        assert time.monotonic() < deadline, f"pending stayed at {holding.pending}, wanted {n}"
        time.sleep(0.01)


def metric(p, name: str) -> float:
    return next(s.value for m in p.stats.registry.collect() for s in m.samples if s.name == name)


def no_endpoint_error(responses) -> tuple[dict, dict]:
    final = responses[-1].immediate_response
    assert final.status.code == 503
    return json.loads(final.body)["error"], {h.header.key: h.header.raw_value.decode() for h in final.headers.set_headers}


def test_held_request_is_routed_once_an_endpoint_is_ready(picker_factory):
    demand: list[int] = []
    p = held_picker(picker_factory, timeout_s=30, on_demand=demand.append)
    out: list = []
    waiter = threading.Thread(target=lambda: out.append(p.exchange(chat("s", "hi"), timeout=40)))
    waiter.start()
    wait_pending(p.holding, 1)
    assert metric(p, "kvship_router:pending_requests") == 1 and demand == [1]
    time.sleep(0.3)
    assert not out  # still held
    p.pool.update(p.pool.endpoints[0], {"kvship:num_requests_waiting": 0.0})  # a scrape answered
    waiter.join(10)
    assert picked(out[0])[0] == "127.0.0.1:18001"
    assert metric(p, "kvship_router:pending_requests") == 0


def test_hold_timeout_is_a_503_with_retry_after(picker_factory):
    p = held_picker(picker_factory, timeout_s=0.5)
    start = time.monotonic()
    err, headers = no_endpoint_error(p.exchange(chat("s", "hi")))
    assert time.monotonic() - start >= 0.5
    assert err["code"] == "no_endpoint" and "0.5s" in err["message"]
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
    assert p.holding.pending == 0


def test_beyond_the_queue_a_503_at_once(picker_factory):
    p = held_picker(picker_factory, timeout_s=30, max_pending=1)
    first: list = []
    waiter = threading.Thread(target=lambda: first.append(p.exchange(chat("s", "one"), timeout=40)))
    waiter.start()
    wait_pending(p.holding, 1)
    start = time.monotonic()
    err, headers = no_endpoint_error(p.exchange(chat("s", "two")))
    assert time.monotonic() - start < 5 and "too many requests" in err["message"] and headers["retry-after"]
    p.pool.update(p.pool.endpoints[0], {})
    waiter.join(10)
    assert picked(first[0])[0] == "127.0.0.1:18001"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield PickTracer(provider), exporter
    provider.shutdown()


def test_pick_span_continues_the_trace_and_parents_the_upstream_request(picker_factory, spans):
    tracer, exporter = spans
    p = picker_factory(tracer=tracer)
    responses = p.exchange(chat("s", "hi"))
    upstream = set_headers(responses[-1])["traceparent"]
    (span,) = exporter.get_finished_spans()
    ctx = span.get_span_context()
    assert span.parent.span_id == int(TRACEPARENT.split("-")[2], 16)
    assert ctx.trace_id == int(TRACEPARENT.split("-")[1], 16)
    assert upstream == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"  # the replica's parent is the pick
    assert span.attributes["kvship.router.endpoint"] == picked(responses)[0]
    assert span.attributes["kvship.router.reason"] == "prefix-miss"


def test_a_request_without_traceparent_starts_a_trace(picker_factory, spans):
    tracer, exporter = spans
    p = picker_factory(tracer=tracer)
    upstream = set_headers(p.exchange(chat("s", "hi"), traceparent=None)[-1])["traceparent"]
    (span,) = exporter.get_finished_spans()
    assert span.parent is None
    assert upstream.split("-")[1] == f"{span.get_span_context().trace_id:032x}"


def test_demand_command_runs_with_the_pending_count(tmp_path):
    out = tmp_path / "demand"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['KVSHIP_ROUTER_PENDING'])"
    hook = demand_command(f"{sys.executable} -c {shlex.quote(script)}")
    hook(1)
    deadline = time.monotonic() + 20
    while any(t.name == "kvship-router-demand" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert out.read_text() == "1"
