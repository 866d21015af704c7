"""The picker's index of what each engine caches, fed by real `kvship serve` engines (the bundled
model) publishing KV-cache events: blocks a prompt left on an engine by another way than the
picker show up under that engine, a request sharing the prompt is picked there for that reason,
and an engine that stops clears its blocks. Without a reported match the picker falls back to
its own record of where it sent a prompt."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kvship.core.kv_events import block_hashes
from kvship.router.kv_events import CachedBlocks, EventSubscriber
from kvship.router.pool import Endpoint, Pool, endpoint_from_url
from kvship.router.scrape import Scraper
from picker_utils import PickerServer, chat, picked
from server_utils import ServerProcess, free_port

pytestmark = pytest.mark.timeout(180)  # two engines start side by side

SYSTEMS = [f"You are the help desk of shop {g}. " + f"Shop {g} opens at {g + 8} and sells hats. " * 10
           for g in range(2)]


def until(predicate, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engines():
    ports = [free_port() for _ in SYSTEMS]
    servers = [ServerProcess("--max-model-len", "512", "--kv-cache-memory", "64MiB", "--shutdown-timeout", "1",
                             "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                               "endpoint": f"tcp://127.0.0.1:{port}"}))
               for port in ports]
    try:
        for s in servers:
            s.wait_ready()
        yield [(s, f"tcp://127.0.0.1:{port}") for s, port in zip(servers, ports)]
    finally:
        for s in servers:
            s.stop(15)


def test_engines_reported_blocks_steer_the_pick(engines):
    endpoints = [endpoint_from_url(s.url) for s, _ in engines]
    cached = CachedBlocks()
    pool = Pool(endpoints, "prefix", cached=cached)
    sources = {e.address: source for e, (_, source) in zip(endpoints, engines)}
    subscriber = EventSubscriber(cached, lambda: sources)
    subscriber.start()
    scraper = Scraper(pool, 0.2)
    scraper.start()
    picker = PickerServer(pool)
    try:
        time.sleep(0.5)  # the subscriptions settle (a PUB socket drops what comes before)
        model = httpx.get(engines[0][0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        expected = []
        for (server, _), system in zip(engines, SYSTEMS):  # each prompt sent straight to one engine
            messages = chat(system, "When do you open?")["messages"]
            r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                           json={"model": model, "messages": messages, "max_tokens": 1})
            assert r.status_code == 200, r.text
            tokens = httpx.post(server.url + "/tokenize", timeout=10,
                                json={"model": model, "messages": messages}).json()["tokens"]
            expected.append(block_hashes(tokens, 16))
        for i, e in enumerate(endpoints):
            until(lambda: cached.match(e.address, expected[i]) == len(expected[i]), what=f"engine {i}'s blocks")
            assert len(expected[i]) >= 5 and cached.match(endpoints[1 - i].address, expected[i]) == 0
        assert cached.block_size == 16

        # The picker never sent these prompts anywhere: only the engines' reports place them.
        for i, system in enumerate(SYSTEMS):
            header, _ = picked(picker.exchange(dict(chat(system, "Do you sell scarves?"), model=model)))
            assert header == endpoints[i].address
            pool.done(endpoints[i])
        picks = {(s.labels["reason"], s.labels["endpoint"]): s.value for m in picker.stats.registry.collect()
                 for s in m.samples if s.name == "kvship_router:picks_total"}
        assert picks == {("prefix-cached", e.address): 1 for e in endpoints}
        metrics = {s.labels["endpoint"]: s.value for m in picker.stats.registry.collect() for s in m.samples
                   if s.name == "kvship_router:endpoint_cached_blocks"}
        assert all(metrics[e.address] >= len(expected[i]) for i, e in enumerate(endpoints))

        engines[1][0].stop(15)  # its last batch: AllBlocksCleared
        until(lambda: cached.count(endpoints[1].address) == 0, what="the stopped engine's blocks cleared")
        assert cached.match(endpoints[0].address, expected[0]) == len(expected[0])
        assert subscriber.gaps == 0
    finally:
        picker.close()
        scraper.stop()
        subscriber.stop()


def test_without_a_reported_match_the_pickers_own_record_decides():
    cached = CachedBlocks()
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
