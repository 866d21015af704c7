"""GET /metrics: Prometheus text. Names follow vLLM's, under the `kvship:` prefix, so that a vLLM
dashboard user finds what they expect; every series carries `model_name`.

Two sources:
- `EngineStatsCollector` reads `engine.stats()` at scrape time: running / waiting requests,
  KV-cache usage, prefix-cache queries and hits, preemptions, prompt and generation tokens,
  and the cache's configuration (`kvship:cache_config_info`: block count, block size, dtype).
- With --enable-lora, `kvship:lora_requests_info` (vLLM's: adapters of running / waiting requests
  and max_lora as labels) and `kvship:lora_requests_total` per adapter.
- `RequestMetrics` is fed by the server as each engine request ends (`RequestObserver`): outcomes
  by finish reason and latency / size histograms, from the timestamps in `RequestOutput`.

Each app has its own CollectorRegistry (several apps, e.g. in tests, never collide); more
collectors can be registered on `app.state.kvship_metrics.registry`.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import kvship
from kvship.core.async_engine import QueueFullError
from kvship.outputs import RequestOutput
from kvship.sampling_params import InvalidParamsError, SamplingParams
from kvship.server.state import ServerState
from kvship.server.tracing import WallClock, add_lifecycle_events, request_span, set_request_attributes, set_usage

logger = logging.getLogger("kvship.server")

router = APIRouter()

FINISH_REASONS = ("stop", "length", "abort", "error")

# Latency buckets (seconds): fine below a second for TTFT / inter-token time, out to minutes for
# whole requests on slow hardware.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int | None) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (or 100k when it is not known yet)."""
    limit = max_model_len or 100_000
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class EngineStatsCollector(Collector):
    """Gauges and counters from the engine's own counters, read at scrape time."""

    def __init__(self, state: ServerState):
        self._state = state  # the engine may be attached after the app is built

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvship:build_info", "kvship build information (always 1).", labels=["version"])
        info.add_metric([kvship.__version__], 1.0)
        yield info
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
            c = CounterMetricFamily(name, doc, labels=labels)  # exposed with the _total suffix
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
        yield gauge("kvship:num_kv_blocks", "KV-cache blocks allocated.", total)
        yield gauge("kvship:num_kv_blocks_used", "KV-cache blocks held by requests.", s.num_kv_blocks_used)
        yield gauge("kvship:num_kv_blocks_free", "KV-cache blocks free (cached prefixes included).", s.num_kv_blocks_free)
        yield counter("kvship:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("kvship:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("kvship:num_preemptions", "Requests preempted (recomputed later).", s.num_preemptions)
        yield counter("kvship:prompt_tokens", "Prompt tokens processed (once per sequence).", s.prompt_tokens_total)
        yield counter("kvship:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode, labels, values)
        yield gauge("kvship:engine_alive", "1 while the engine's step loop runs.", 1.0 if engine.is_alive() else 0.0)
        # vLLM's cache_config_info: the KV cache's fixed facts as labels of a constant 1
        cache = GaugeMetricFamily("kvship:cache_config_info", "KV-cache configuration (always 1).",
                                  labels=[*labels, "num_gpu_blocks", "block_size", "cache_dtype"])
        cache.add_metric([*values, str(total), str(engine.config.block_size), engine.config.kv_cache_dtype], 1.0)
        yield cache
        if engine.config.enable_lora:
            yield from _lora_metrics(labels, values, engine.config.max_loras, s)


def _lora_metrics(labels: list[str], values: list[str], max_loras: int, s) -> Iterator[Metric]:
    """vLLM's lora_requests_info (adapters as comma-joined labels, the scrape time as its value:
    the Gateway API Inference Extension's LoRA-affinity scorer reads it) and requests per adapter."""
    info = GaugeMetricFamily("kvship:lora_requests_info", "LoRA adapters of running and waiting requests.",
                             labels=[*labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    info.add_metric([*values, str(max_loras), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)],
                    time.time())
    yield info
    per = CounterMetricFamily("kvship:lora_requests", "Requests submitted per LoRA adapter.", labels=[*labels, "lora_name"])
    for name, n in sorted(s.lora_requests_total.items()):
        per.add_metric([*values, name], n)
    yield per


def _spec_decode_metrics(spec, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """Speculative decoding's counters as vLLM names them (exposed with the _total suffix)."""
    for name, doc, value in (
            ("num_drafts", "Verify passes of a sequence with proposed tokens.", spec.num_drafts),
            ("num_draft_tokens", "Proposed tokens.", spec.num_draft_tokens),
            ("num_accepted_tokens", "Proposed tokens accepted.", spec.num_accepted_tokens)):
        c = CounterMetricFamily(f"kvship:spec_decode_{name}", doc, labels=labels)
        c.add_metric(values, value)
        yield c
    per_pos = CounterMetricFamily("kvship:spec_decode_num_accepted_tokens_per_pos",
                                  "Proposed tokens accepted, by their position in the proposal (from 0).",
                                  labels=[*labels, "position"])
    for position, accepted in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([*values, str(position)], accepted)
    yield per_pos


class RequestMetrics:
    """Per-request outcomes and histograms. One observation per engine request (a completions
    call with several prompts makes one engine request per prompt); request_success counts
    choices (n > 1 counts each), as engines that fan n out into sub-requests do."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int | None = None):
        L = ["model_name"]
        r = registry
        self.success = Counter("kvship:request_success", "Finished requests (choices) by finish reason.",
                               L + ["finished_reason"], registry=r)
        self.ttft = Histogram("kvship:time_to_first_token_seconds", "Time from arrival to the first token.",
                              L, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvship:time_per_output_token_seconds",
                              "Mean inter-token time of a request (decode time / (output tokens - 1)); "
                              "requests with at least two output tokens.", L, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvship:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             L, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("kvship:request_queue_time_seconds", "Time from arrival to first being scheduled.",
                               L, buckets=REQUEST_BUCKETS, registry=r)
        self.prefill = Histogram("kvship:request_prefill_time_seconds",
                                 "Time from first being scheduled to the first token.", L, buckets=REQUEST_BUCKETS,
                                 registry=r)
        self.decode = Histogram("kvship:request_decode_time_seconds", "Time from the first token to the last.",
                                L, buckets=REQUEST_BUCKETS, registry=r)
        tb = token_buckets(max_model_len)
        self.prompt_tokens = Histogram("kvship:request_prompt_tokens", "Prompt length of finished requests.",
                                       L, buckets=tb, registry=r)
        self.generation_tokens = Histogram("kvship:request_generation_tokens",
                                           "Generated tokens of finished requests (all choices).", L, buckets=tb,
                                           registry=r)
        self.max_tokens = Histogram("kvship:request_params_max_tokens", "max_tokens of finished requests.",
                                    L, buckets=tb, registry=r)
        self._models: set[str] = set()

    def _touch(self, model: str) -> None:
        # Every finish reason shows up (at 0) from the first request on, so rate() works at once.
        if model not in self._models:
            self._models.add(model)
            for reason in FINISH_REASONS:
                self.success.labels(model, reason)

    def observe_finished(self, model: str, out: RequestOutput, max_tokens: int | None) -> None:
        self._touch(model)
        for c in out.outputs:
            self.success.labels(model, c.finish_reason or "stop").inc()
        arrival, sched, first, done = out.arrival_time, out.first_scheduled_time, out.first_token_time, out.finished_time
        if done is None:
            done = time.monotonic()
        self.e2e.labels(model).observe(max(0.0, done - arrival))
        if sched is not None:
            self.queue.labels(model).observe(max(0.0, sched - arrival))
        if first is not None:
            self.ttft.labels(model).observe(max(0.0, first - arrival))
            if sched is not None:
                self.prefill.labels(model).observe(max(0.0, first - sched))
            self.decode.labels(model).observe(max(0.0, done - first))
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if longest > 1:
                self.tpot.labels(model).observe(max(0.0, done - first) / (longest - 1))
        self.prompt_tokens.labels(model).observe(len(out.prompt_token_ids))
        self.generation_tokens.labels(model).observe(sum(len(c.token_ids) for c in out.outputs))
        if max_tokens is not None:
            self.max_tokens.labels(model).observe(max_tokens)

    def observe_aborted(self, model: str, choices: int) -> None:
        self._touch(model)
        if choices > 0:
            self.success.labels(model, "abort").inc(choices)


class RequestObserver:
    """Watches one API request's engine requests (one per prompt) as their outputs stream by:
    records the metrics when each ends, and writes the span's events and usage when tracing is
    on. Fed by GenerationStream; never raises into it."""

    def __init__(self, metrics: RequestMetrics, model: str, params: SamplingParams, n_prompts: int,
                 span: Any | None = None):
        self._metrics = metrics
        self._model = model
        self._n = params.n
        self._max_tokens = params.max_tokens
        self._lasts: list[RequestOutput | None] = [None] * n_prompts
        self._left = n_prompts
        self._span = span
        self._clock: WallClock | None = None
        if span is not None:
            self._clock = WallClock()

    def on_output(self, index: int, out: RequestOutput) -> None:
        self._lasts[index] = out
        if not out.finished:
            return
        try:
            self._metrics.observe_finished(self._model, out, self._max_tokens)
            if self._span is not None:
                add_lifecycle_events(self._span, out, self._clock, prompt_index=self._prompt_index(index))
        except Exception:  # noqa: BLE001 - observing must never fail a request
            logger.exception("recording request metrics failed")

    def on_end(self, index: int, error: BaseException | None) -> None:
        """The engine request of prompt `index` is over: finished, aborted, failed or refused."""
        try:
            last = self._lasts[index]
            refused = isinstance(error, (QueueFullError, InvalidParamsError))
            if (last is None or not last.finished) and not refused:
                done = sum(1 for c in last.outputs if c.finished) if last is not None else 0
                self._metrics.observe_aborted(self._model, self._n - done)
                if self._span is not None:
                        add_lifecycle_events(self._span, last, self._clock, prompt_index=self._prompt_index(index),
                                         aborted=True)
            self._left -= 1
            if self._left == 0 and self._span is not None:
                set_usage(self._span, self._lasts)
        except Exception:
            logger.exception("recording request metrics failed")

    def _prompt_index(self, index: int) -> int | None:
        return index if len(self._lasts) > 1 else None


def observe_request(request: Request, request_id: str, params: SamplingParams, n_prompts: int = 1) -> RequestObserver:
    """The observer for one API request (handed to GenerationStream); fills in the request
    attributes of the request's span when tracing is on."""
    state: ServerState = request.app.state.kvship
    model = state.model_name
    span = request_span(request)
    if span is not None:
        try:
            set_request_attributes(span, model=model, request_id=request_id, params=params)
        except Exception:
            logger.exception("setting span attributes failed")
    return RequestObserver(request.app.state.kvship_metrics.requests, model, params, n_prompts, span)


class ServerMetrics:
    def __init__(self, state: ServerState):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(state))
        self.requests = RequestMetrics(self.registry, state.max_model_len)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    m: ServerMetrics = request.app.state.kvship_metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
