"""The endpoint picker alone, through a real gRPC client speaking Envoy's ext_proc protocol on
loopback: the pick arrives as the GIE header and `envoy.lb` metadata; an empty pool gets an
immediate OpenAI-shaped error; load read from real /metrics pages steers least-load and the bound."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import picker_utils
from kvship.core.kv_events import block_hashes
from kvship.router import prompt
from kvship.router.kv_events import CachedBlocks, request_block_hashes
from kvship.router.pool import Endpoint, Pool, endpoint_from_url
from kvship.router.scrape import MAX_SLOW, Scraper
from picker_utils import ADDRESSES, chat, picked

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def picker_factory():
    yield from picker_utils.picker_factory()


def test_headers_and_body_in_endpoint_header_and_metadata_out(picker_factory):
    p = picker_factory()
    responses = p.exchange(chat("You are terse. " * 20, "hi"))
    assert len(responses) == 2
    assert responses[0].HasField("request_headers")  # headers: continue, the body decides
    assert not responses[0].request_headers.response.header_mutation.set_headers
    assert responses[1].HasField("request_body")
    header, meta = picked(responses)
    assert header in ADDRESSES
    assert meta[0] == header  # the pick first, then fallbacks: the other endpoints, no repeats
    assert sorted(meta) == sorted(ADDRESSES)


def test_request_without_body_is_picked_on_its_headers(picker_factory):
    p = picker_factory()
    responses = p.exchange(None, path="/v1/models")
    assert len(responses) == 1 and responses[0].HasField("request_headers")
    header, meta = picked(responses)
    assert header in ADDRESSES and meta[0] == header


def test_empty_pool_is_an_immediate_openai_error(picker_factory):
    p = picker_factory(addresses=[])
    responses = p.exchange(chat("sys", "hi"))
    final = responses[-1]
    assert final.HasField("immediate_response")
    assert final.immediate_response.status.code == 503
    body = json.loads(final.immediate_response.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "no_endpoint" and body["error"]["message"]
    hdrs = {h.header.key: h.header.raw_value for h in final.immediate_response.headers.set_headers}
    assert hdrs["content-type"] == b"application/json" and "retry-after" in hdrs


def test_prefix_groups_stick_and_spread(picker_factory):
    p = picker_factory(addresses=ADDRESSES)
    systems = [f"System prompt of tenant {g}: " + f"rule {g} applies. " * 30 for g in range(3)]
    first = {}
    for turn in range(4):
        for g, system in enumerate(systems):
            header, _ = picked(p.exchange(chat(system, f"question {turn}")))
            p.pool.done(next(e for e in p.pool.endpoints if e.address == header))  # the answer came back
            first.setdefault(g, header)
            assert header == first[g], f"group {g} moved at turn {turn}"
    assert len(set(first.values())) == 3  # new prefixes go to the least loaded endpoint
    reasons: dict[str, float] = {}
    for m in p.stats.registry.collect():
        for s in m.samples:
            if s.name == "kvship_router:picks_total":
                reasons[s.labels["reason"]] = reasons.get(s.labels["reason"], 0) + s.value
    assert reasons["prefix-hit"] == 9 and reasons["prefix-miss"] == 3


def test_round_robin_spreads_one_prefix(picker_factory):
    p = picker_factory(policy="round-robin")
    seen = [picked(p.exchange(chat("same system " * 30, f"q{i}")))[0] for i in range(6)]
    assert seen[:3] != [seen[0]] * 3 and sorted(seen[:3]) == sorted(ADDRESSES) and seen[3:] == seen[:3]


def test_bounded_load_moves_an_overloaded_prefix_holder():
    pool = Pool([Endpoint("a:1", "http://a:1"), Endpoint("b:1", "http://b:1")], "prefix", load_epsilon=0.25)
    hashes = [b"h1", b"h2"]
    first = pool.pick(hashes)
    assert first.reason == "prefix-miss"
    assert pool.pick(hashes).endpoint is first.endpoint  # load 1 vs 0: cap ceil(1.25 * 2 / 2) = 2
    third = pool.pick(hashes)  # the holder at 2, the other at 0: 3 > ceil(1.25 * 3 / 2) = 2
    assert third.reason == "prefix-overload" and third.endpoint is not first.endpoint
    assert pool.pick(hashes).reason == "prefix-hit"  # both hold it now


class MetricsPage:
    """A real HTTP server with a model server's /metrics names, values set by the test."""

    def __init__(self, waiting: float, running: float, kv: float):
        self.delay = 0.0  # seconds before answering
        page = self
        text = (f"# TYPE kvship:num_requests_waiting gauge\nkvship:num_requests_waiting{{model_name=\"m\"}} {waiting}\n"
                f"kvship:num_requests_running{{model_name=\"m\"}} {running}\n"
                f"kvship:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n").encode()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                time.sleep(page.delay)
                self.send_response(200)
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def test_least_load_from_scraped_metrics_and_dead_endpoint_skipped():
    pages = [MetricsPage(5, 4, 0.9), MetricsPage(0, 1, 0.2), MetricsPage(2, 4, 0.5)]
    dead = MetricsPage(0, 0, 0.0)
    dead.close()  # nothing listens there any more
    try:
        pool = Pool([endpoint_from_url(p.url) for p in [*pages, dead]], "least-load")
        scraper = Scraper(pool, 0.5)
        scraper.scrape_once()
        scraper.stop()
        assert [e.healthy for e in pool.endpoints] == [True, True, True, False]
        assert pool.endpoints[0].waiting == 5 and pool.endpoints[2].kv_usage == 0.5
        picks = [pool.pick([]) for _ in range(4)]
        assert all(p.endpoint is not pool.endpoints[3] for p in picks)
        assert picks[0].endpoint is pool.endpoints[1]  # nothing waiting
        assert picks[0].reason == "least-load"
        # Its own picks count as load: after two more it is level with the third endpoint (2 waiting).
        assert {p.endpoint.address for p in picks} == {pool.endpoints[1].address, pool.endpoints[2].address}
    finally:
        for p in pages:
            p.close()


def test_a_slow_scrape_keeps_the_endpoint_until_several_in_a_row():
    """A busy engine that answers /metrics late keeps its place (and its prefixes) with its last
    reading; only MAX_SLOW timeouts in a row take it out, and one answer brings it back."""
    page = MetricsPage(3, 1, 0.4)
    try:
        pool = Pool([endpoint_from_url(page.url)], "prefix")
        endpoint = pool.endpoints[0]
        scraper = Scraper(pool, 0.1)  # a scrape waits 0.2 s
        scraper.scrape_once()
        pool.index.record(endpoint.address, [b"p"])
        page.delay = 0.6
        for _ in range(MAX_SLOW - 1):
            scraper.scrape_once()
            assert endpoint.healthy and endpoint.waiting == 3 and pool.index.match(endpoint.address, [b"p"]) == 1
        scraper.scrape_once()
        assert not endpoint.healthy and pool.index.match(endpoint.address, [b"p"]) == 0
        page.delay = 0.0
        scraper.scrape_once()
        assert endpoint.healthy
        scraper.stop()
    finally:
        page.close()


def test_without_a_reported_match_the_pickers_own_record_decides():
    cached = CachedBlocks()  # what engines report (their KV-cache events)
    a, b = Endpoint("a:1", "http://a:1"), Endpoint("b:1", "http://b:1")
    pool = Pool([a, b], "prefix", cached=cached)
    cached.apply("b:1", [["BlockStored", [11, 12], None, list(range(32)), 16, None, None]])
    assert pool.pick([b"t1"], [11, 12, 13]).endpoint is b  # reported: b holds two blocks
    first = pool.pick([b"t2"], [21])
    assert first.reason == "prefix-miss"
    again = pool.pick([b"t2"], [21])  # nothing reported for it (still in flight): where it was sent
    assert again.reason == "prefix-hit" and again.endpoint is first.endpoint
    cached.apply("b:1", [["BlockRemoved", [12], None]])
    assert cached.match("b:1", [11, 12]) == 1
    cached.apply("b:1", [["AllBlocksCleared"]])
    assert cached.count("b:1") == 0


def test_request_tokens_come_from_an_engines_tokenize_with_the_requests_key():
    """/tokenize on a real HTTP server that wants a key, as `kvship serve --api-key` does."""
    seen: list[dict] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            ok = self.headers.get("authorization") == "Bearer k"
            body = json.dumps({"tokens": list(range(40))} if ok else {"error": {}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        live = [endpoint_from_url(f"http://127.0.0.1:{httpd.server_address[1]}")]
        cached = CachedBlocks()
        parsed = prompt.parse(json.dumps(chat("sys", "hi")).encode(), 64)
        assert request_block_hashes(parsed, cached, live, "Bearer k") == []  # no block size reported yet
        cached.apply("x", [["BlockStored", [1], None, list(range(16)), 16, None, None]])
        assert request_block_hashes(parsed, cached, live, "Bearer k") == block_hashes(list(range(40)), 16)
        assert seen[-1] == {"model": "m", "messages": chat("sys", "hi")["messages"]}
        assert request_block_hashes(parsed, cached, live, None) == []  # refused: the picker's own record decides
        ids = prompt.parse(json.dumps({"prompt": list(range(20))}).encode(), 64)
        calls = len(seen)
        assert request_block_hashes(ids, cached, live) == block_hashes(list(range(20)), 16) and len(seen) == calls
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)
