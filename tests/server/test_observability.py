"""Metrics and traces, end to end: an in-process app on a real engine (bundled SmolLM2 on CPU)
with an in-memory span exporter, /metrics checked against the usage the API returned, and a
real `kvship serve` exporting over OTLP/HTTP to a receiver on loopback that decodes the
protobuf it gets."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otlp_utils import OTLPReceiver
from server_utils import start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
             "OTEL_SDK_DISABLED")


@pytest.fixture(scope="module")
def engine():
    from kvship.config import EngineConfig
    from kvship.core.async_engine import AsyncEngine

    eng = AsyncEngine.from_config(EngineConfig(device="cpu", max_model_len=1024, kv_cache_memory=256 << 20))
    yield eng
    eng.shutdown()


@pytest.fixture()
def no_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def traced_app(engine):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvship.server.app import build_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return build_app(engine, engine.config, chat_page=False, tracer_provider=provider), exporter


async def post_all(app, requests: list[tuple[str, dict, dict]]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvship.test", timeout=120) as client:
        out = []
        for path, body, headers in requests:
            out.append(await client.post(path, json=body, headers=headers))
        return out


def run(app, *requests: tuple[str, dict, dict]) -> list[httpx.Response]:
    responses = asyncio.run(post_all(app, list(requests)))
    for r in responses:
        assert r.status_code == 200, r.text
    return responses


def sse_usage(resp: httpx.Response) -> dict:
    import json

    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c.get("finish_reason")]
    return {"usage": usage, "reasons": reasons}


# ------------------------------------------------------------------ traces, in process


def test_chat_span_continues_traceparent_with_genai_attributes_and_events(engine, no_otel_env):
    app, exporter = traced_app(engine)
    model = engine.model_name
    body = {"model": model, "messages": QUESTION, "max_tokens": 5, "temperature": 0.0, "top_p": 0.9}
    (resp,) = run(app, ("/v1/chat/completions", body, {"traceparent": TRACEPARENT}))
    answer = resp.json()

    spans = exporter.get_finished_spans()
    assert len(spans) == 1, spans
    span = spans[0]
    from opentelemetry.trace import SpanKind

    assert span.kind == SpanKind.SERVER
    assert span.name == f"chat {model}"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    assert span.parent.is_remote
    a = dict(span.attributes)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.response.id"] == answer["id"]
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert list(a["gen_ai.response.finish_reasons"]) == [answer["choices"][0]["finish_reason"]]
    assert a["http.response.status_code"] == 200

    names = [e.name for e in span.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    stamps = [e.timestamp for e in span.events]
    assert stamps == sorted(stamps)
    # Engine times mapped onto the wall clock fall inside the span (1 ms slack for rounding).
    assert span.start_time - 1_000_000 <= stamps[0] and stamps[-1] <= span.end_time + 1_000_000
    finished = span.events[-1].attributes
    assert finished["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]


def test_streamed_completion_span_and_untraced_request(engine, no_otel_env):
    app, exporter = traced_app(engine)
    body = {"model": engine.model_name, "prompt": ["The capital of France is", "One, two,"], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    (resp,) = run(app, ("/v1/completions", body, {}))
    got = sse_usage(resp)
    (span,) = exporter.get_finished_spans()
    assert span.parent is None  # no traceparent: a new trace
    a = dict(span.attributes)
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == got["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == got["usage"]["completion_tokens"] == 6
    assert list(a["gen_ai.response.finish_reasons"]) == ["length", "length"]
    # Two prompts: each has its own lifecycle events, told apart by prompt index.
    by_prompt = {}
    for e in span.events:
        by_prompt.setdefault(e.attributes["kvship.prompt_index"], []).append(e.name)
    assert by_prompt == {i: ["queued", "scheduled", "first_token", "finished"] for i in (0, 1)}


def test_tracing_is_off_without_otel_settings(engine, no_otel_env):
    from kvship.server.app import build_app
    from kvship.server.tracing import TracingMiddleware
    from kvship.telemetry import tracing_requested

    assert not tracing_requested()
    assert not tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"})
    assert not tracing_requested({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"})
    app = build_app(engine, engine.config, chat_page=False)
    assert app.state.kvship_tracing is None
    assert not any(m.cls is TracingMiddleware for m in app.user_middleware)
    (resp,) = run(app, ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}, {"traceparent": TRACEPARENT}))
    assert resp.json()["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------ metrics, in process


def scrape(app) -> dict[tuple[str, tuple], float]:
    async def get() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvship.test") as client:
            return (await client.get("/metrics")).text

    out = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_match_the_usage_returned(engine, no_otel_env):
    from kvship.server.app import build_app

    app = build_app(engine, engine.config, chat_page=False)  # fresh registry: histograms start at 0
    model = engine.model_name
    m = {"model_name": model}
    before = scrape(app)
    assert value(before, "kvship:build_info", version=__import__("kvship").__version__) == 1.0

    long_question = [{"role": "user", "content": "Tell me about Paris, its history, its museums and its food. " * 3}]
    first, again, cmpl = run(
        app,
        ("/v1/chat/completions", {"messages": long_question, "max_tokens": 2, "temperature": 0}, {}),
        ("/v1/chat/completions", {"messages": long_question, "max_tokens": 2, "temperature": 0}, {}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}, {}),
    )
    mid = scrape(app)
    (streamed,) = run(app, ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 40, "temperature": 0,
                                                     "stream": True, "stream_options": {"include_usage": True}}, {}))
    after = scrape(app)

    usages = [r.json()["usage"] for r in (first, again, cmpl)] + [sse_usage(streamed)["usage"]]
    reasons = [r.json()["choices"][0]["finish_reason"] for r in (first, again, cmpl)] + sse_usage(streamed)["reasons"]
    assert reasons[:3] == ["length", "length", "length"]
    n = len(usages)
    prompt_sum = sum(u["prompt_tokens"] for u in usages)
    gen_sum = sum(u["completion_tokens"] for u in usages)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvship:prompt_tokens_total", **m) == prompt_sum
    assert delta("kvship:generation_tokens_total", **m) == gen_sum
    for reason in ("stop", "length", "abort"):
        assert value(after, "kvship:request_success_total", finished_reason=reason, **m) == reasons.count(reason), reason
    for h in ("kvship:e2e_request_latency_seconds", "kvship:time_to_first_token_seconds",
              "kvship:request_queue_time_seconds", "kvship:request_prefill_time_seconds",
              "kvship:request_prompt_tokens", "kvship:request_generation_tokens"):
        assert value(after, h + "_count", **m) == n, h
        assert value(after, h + "_bucket", le="+Inf", **m) == n, h
    assert value(after, "kvship:time_per_output_token_seconds_count", **m) == sum(
        1 for u in usages if u["completion_tokens"] > 1)
    assert value(after, "kvship:request_prompt_tokens_sum", **m) == prompt_sum
    assert value(after, "kvship:request_generation_tokens_sum", **m) == gen_sum
    assert value(after, "kvship:e2e_request_latency_seconds_sum", **m) >= value(
        after, "kvship:time_to_first_token_seconds_sum", **m) > 0
    # The repeated prompt was served from the prefix cache.
    assert value(mid, "kvship:prefix_cache_hits_total", **m) - value(before, "kvship:prefix_cache_hits_total", **m) > 0
    assert value(mid, "kvship:prefix_cache_queries_total", **m) > value(before, "kvship:prefix_cache_queries_total", **m)
    # Idle again: the gauges the autoscaler reads are back at 0.
    assert value(after, "kvship:num_requests_running", **m) == 0
    assert value(after, "kvship:num_requests_waiting", **m) == 0
    assert 0 <= value(after, "kvship:kv_cache_usage_perc", **m) <= 1
    # The cache's facts: the blocks the runner allocated in --kv-cache-memory, 30 layers of 3 KV
    # heads of 64 channels a token (the bundled SmolLM2), keys and values, in the model's dtype
    runner = engine.engine.runner
    per_block = 30 * 2 * 3 * 64 * engine.config.block_size * runner.dtype.itemsize
    assert runner.num_blocks == (256 << 20) // per_block
    assert value(after, "kvship:cache_config_info", num_gpu_blocks=str(runner.num_blocks),
                 block_size=str(engine.config.block_size), cache_dtype="auto", **m) == 1.0


def test_grafana_dashboard_uses_only_exported_metrics(engine, no_otel_env):
    import json
    import re
    from pathlib import Path

    from kvship.server.app import build_app

    path = Path(__file__).resolve().parents[2] / "charts" / "kvship-operator" / "dashboards" / "kvship-engine.json"
    dash = json.loads(path.read_text())
    assert dash["uid"] == "kvship-engine"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"kvship:[a-z0-9_]+", e)}

    app = build_app(engine, engine.config, chat_page=False)
    run(app, ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}, {}))
    exported = {name for name, _ in scrape(app)}
    assert used and used <= exported, used - exported


# ------------------------------------------------------------------ OTLP/HTTP to a real receiver


def test_kvship_serve_exports_spans_over_otlp_http():
    receiver = OTLPReceiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    server = start_server("--max-model-len", "512", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "2",
                          "--no-chat-page", env=env)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0.5,
                                              top_p=0.8, seed=1, extra_headers={"traceparent": TRACEPARENT})
        stream = client.completions.create(model=model, prompt="Hello, my name is", max_tokens=3, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        usage = chunks[-1].usage
        # A stream the client walks away from is aborted: counted, and its span says so.
        cut = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True})
        next(iter(cut))
        cut.close()
        server.wait_metric("kvship:num_requests_running", lambda v: v == 0, timeout=15)
        metrics = {(s.name, s.labels.get("finished_reason")): s.value
                   for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text) for s in f.samples}
        # /metrics and /health are not traced: only the three API requests make spans.
        spans = receiver.wait_for(3)
        time.sleep(0.5)
        assert len(receiver.spans) == 3, receiver.spans
    finally:
        code = server.stop()
        receiver.close()
    assert code == 0, server.log()

    assert metrics[("kvship:request_success_total", "abort")] == 1
    reasons = [chat.choices[0].finish_reason, "length"]
    for reason in ("stop", "length"):
        assert metrics[("kvship:request_success_total", reason)] == reasons.count(reason), reason
    aborted = [s for s in spans if s["events"] and s["events"][-1][0] == "aborted"]
    assert len(aborted) == 1 and aborted[0]["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
    spans = [s for s in spans if s not in aborted]
    by_op = {s["attributes"]["gen_ai.operation.name"]: s for s in spans}
    c = by_op["chat"]
    assert c["name"] == f"chat {model}" and c["kind"] == 2  # SPAN_KIND_SERVER
    assert c["trace_id"] == TRACE_ID and c["parent_span_id"] == PARENT_SPAN_ID
    assert c["resource"]["service.name"] == "kvship"
    a = c["attributes"]
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.8)
    assert a["gen_ai.request.seed"] == 1
    assert a["gen_ai.response.id"] == chat.id
    assert a["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [chat.choices[0].finish_reason]
    assert [name for name, _ in c["events"]] == ["queued", "scheduled", "first_token", "finished"]
    stamps = [t for _, t in c["events"]]
    assert stamps == sorted(stamps) and abs(stamps[0] / 1e9 - time.time()) < 300

    t = by_op["text_completion"]
    assert t["trace_id"] != TRACE_ID and t["parent_span_id"] == ""
    assert t["attributes"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert t["attributes"]["gen_ai.usage.output_tokens"] == usage.completion_tokens == 3
    assert t["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
