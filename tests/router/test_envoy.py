"""Envoy + the endpoint picker + three `kvship serve` of the bundled model, all real processes on
loopback: prefix groups stay on one replica each and spread over the replicas, round-robin
spreads one group, the replicas' KV-cache events steer a router that reads them, SSE arrives
chunk by chunk through Envoy, a killed replica leaves the pool, and rejoins when restarted."""
from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from router_utils import RouterProcess
from server_utils import ServerProcess, free_port

pytestmark = pytest.mark.timeout(900)

MODEL = ""  # the served model's name, read from the first replica
SERVE_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "128MiB", "--shutdown-timeout", "2")


def start_replica(events: str, port: int | None = None) -> ServerProcess:
    """A replica publishing its KV-cache events on `events`."""
    server = ServerProcess(*SERVE_ARGS, "--kv-events-config",
                           json.dumps({"enable_kv_cache_events": True, "endpoint": events}), port=port)
    server.events = events
    return server


@pytest.fixture(scope="module")
def replicas():
    servers = [start_replica(f"tcp://127.0.0.1:{free_port()}") for _ in range(3)]  # load side by side
    try:
        for s in servers:
            s.wait_ready()
        global MODEL
        MODEL = httpx.get(servers[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield servers
    finally:
        for s in servers:
            s.stop(15)


@pytest.fixture(scope="module")
def routers(replicas):
    urls = [s.url for s in replicas]
    made = {policy: RouterProcess(urls, policy) for policy in ("prefix", "round-robin")}
    # Replicas as an Envoy cluster (retries go to the picker's fallbacks), and a picker that
    # reads /metrics too rarely to notice a dead replica within the test.
    made["fallback"] = RouterProcess(urls, "prefix", "--envoy-cluster", "endpoints", "--scrape-interval", "60")
    # One that reads what the replicas report caching.
    made["cached"] = RouterProcess(urls, "prefix", "--scrape-interval", "0.2",
                                   *(a for s in replicas for a in ("--kv-events", s.events)))
    try:
        for r in made.values():
            r.wait_ready()
        yield made
    finally:
        codes = {policy: r.stop() for policy, r in made.items()}
        assert set(codes.values()) == {0}, {p: r.log() for p, r in made.items()}


SYSTEMS = [f"You are the assistant of tenant {g}. " + f"Tenant {g} policy clause {g}: answer briefly. " * 12
           for g in range(4)]


def ask(router: RouterProcess, system: str, user: str, client: httpx.Client) -> httpx.Response:
    return client.post(router.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})


def wait_idle(router: RouterProcess, addresses: set[str], timeout: float = 10) -> None:
    """Until the picker counts no load anywhere: Envoy ends a request's ext_proc stream, which
    releases its pick, after the client already has the answer, and the bounded load would move
    a prefix off a replica still counting the request before."""
    deadline = time.monotonic() + timeout
    while any(router.metric("kvship_router:endpoint_load", a) != 0.0 for a in addresses):
        assert time.monotonic() < deadline, router.picker_metrics()
        time.sleep(0.05)


def test_prefix_groups_land_on_one_replica_each(routers, replicas):
    router = routers["prefix"]
    addresses = {s.url.removeprefix("http://") for s in replicas}
    hits_before = sum(s.metrics()["kvship:prefix_cache_hits_total"] for s in replicas)
    served: dict[int, set[str]] = {g: set() for g in range(len(SYSTEMS))}
    with httpx.Client() as client:
        for turn in range(3):  # the groups interleaved
            for g, system in enumerate(SYSTEMS):
                wait_idle(router, addresses)
                r = ask(router, system, f"Question {turn}?", client)
                assert r.status_code == 200, r.text
                served[g].add(r.headers["x-kvship-endpoint"])
    assert all(len(v) == 1 for v in served.values()), served
    used = set().union(*served.values())
    assert used <= addresses and len(used) >= 2, served  # groups spread over the replicas
    hits = sum(s.metrics()["kvship:prefix_cache_hits_total"] for s in replicas) - hits_before
    assert hits > 0  # the second and third turns found their prefix cached on their replica
    # A client's own destination header is overwritten by the pick: the picker's port is not reachable.
    with httpx.Client() as client:
        spoofed = client.post(router.url + "/v1/chat/completions", timeout=120,
                              headers={"x-gateway-destination-endpoint": f"127.0.0.1:{router.metrics_port}"},
                              json={"model": MODEL, "max_tokens": 1,
                                    "messages": [{"role": "user", "content": SYSTEMS[0]}]})
    assert spoofed.status_code == 200 and spoofed.headers["x-kvship-endpoint"] in addresses, spoofed.text
    picker = router.picker_metrics()
    assert 'reason="prefix-hit"' in picker
    for address in addresses:  # every request's ext_proc stream ended: nothing counted in flight
        assert f'kvship_router:endpoint_in_flight{{endpoint="{address}"}} 0.0' in picker, picker


def test_round_robin_spreads_one_group(routers, replicas):
    with httpx.Client() as client:
        seen = [ask(routers["round-robin"], SYSTEMS[0], f"Q{i}", client).headers["x-kvship-endpoint"]
                for i in range(3)]
    assert sorted(seen) == sorted(s.url.removeprefix("http://") for s in replicas)


def test_blocks_the_replicas_report_steer_the_pick(routers, replicas):
    """Prompts sent straight to one replica each, by no router: the replicas' KV-cache events
    tell the router where they are cached, and requests sharing them are sent there."""
    router = routers["cached"]
    hotels = [f"You are the front desk of hotel {i}. " + f"Hotel {i} serves breakfast at {i + 6}. " * 10
              for i in range(len(replicas))]
    addresses = [s.url.removeprefix("http://") for s in replicas]
    before = [router.metric("kvship_router:endpoint_cached_blocks", a) for a in addresses]
    with httpx.Client() as client:
        for server, system in zip(replicas, hotels):
            r = client.post(server.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 1,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 20
        while any(router.metric("kvship_router:endpoint_cached_blocks", a) < b + 5 for a, b in zip(addresses, before)):
            assert time.monotonic() < deadline, router.picker_metrics()
            time.sleep(0.1)
        served = [ask(router, system, "Is there parking?", client).headers["x-kvship-endpoint"] for system in hotels]
    assert served == addresses
    assert sum(router.metric("kvship_router:picks_total", a, reason="prefix-cached") or 0
               for a in addresses) == len(addresses), router.picker_metrics()


def test_sse_stream_arrives_chunk_by_chunk_through_envoy(routers):
    arrivals: list[float] = []
    with httpx.Client() as client, client.stream(
            "POST", routers["prefix"].url + "/v1/chat/completions", timeout=120,
            json={"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True,
                  "messages": [{"role": "user", "content": "Count from one to twenty."}]}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-kvship-endpoint"]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 10
    # Buffered by the proxy, every event would arrive in one burst at the end.
    assert arrivals[-1] - arrivals[0] > 0.05, arrivals


def picks_of(router: RouterProcess, address: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in router.picker_metrics().splitlines()
               if line.startswith("kvship_router:picks_total{") and f'endpoint="{address}"' in line)


def test_killed_replica_requests_still_answered(routers, replicas):
    """Killed while the picker still counts it: Envoy retries the connect failure on the picker's
    fallback; once a scrape fails, the picker leaves it out."""
    with httpx.Client() as client:
        owners = {g: ask(routers["fallback"], system, "Before?", client).headers["x-kvship-endpoint"]
                  for g, system in enumerate(SYSTEMS)}
        victim = next(s for s in replicas if s.url.removeprefix("http://") == owners[0])
        address = owners[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        picked_before = picks_of(routers["fallback"], address)
        for g, system in enumerate(SYSTEMS):  # the fallback router's picker has not noticed
            r = ask(routers["fallback"], system, "After the loss?", client)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvship-endpoint"] != address
        assert f'kvship_router:endpoint_healthy{{endpoint="{address}"}} 1.0' in routers["fallback"].picker_metrics()
        assert picks_of(routers["fallback"], address) > picked_before  # picked, dead, answered by a fallback

        router = routers["prefix"]
        deadline = time.monotonic() + 10
        while f'kvship_router:endpoint_healthy{{endpoint="{address}"}} 0.0' not in router.picker_metrics():
            assert time.monotonic() < deadline, router.picker_metrics()
            time.sleep(0.1)
        for turn in range(2):
            for g, system in enumerate(SYSTEMS):
                r = ask(router, system, f"After the loss {turn}?", client)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvship-endpoint"] != address


def test_replica_rejoins_after_restart(routers, replicas):
    """A replica that died (the test above, or killed here when run alone) is out of the picks;
    started again on its address, it is picked again once a scrape finds it."""
    dead = next((i for i, s in enumerate(replicas) if s.proc.poll() is not None), None)
    if dead is None:
        dead = 0
        replicas[0].proc.kill()
        replicas[0].proc.wait(10)
    address = replicas[dead].url.removeprefix("http://")
    router = routers["round-robin"]
    deadline = time.monotonic() + 10
    while router.metric("kvship_router:endpoint_healthy", address) != 0.0:
        assert time.monotonic() < deadline, router.picker_metrics()
        time.sleep(0.1)
    deadline = time.monotonic() + 10  # the router reading KV events forgets a dead replica's blocks
    while routers["cached"].metric("kvship_router:endpoint_cached_blocks", address) != 0:
        assert time.monotonic() < deadline, routers["cached"].picker_metrics()
        time.sleep(0.1)
    with httpx.Client() as client:
        seen = {ask(router, SYSTEMS[1], f"While down {i}?", client).headers["x-kvship-endpoint"] for i in range(4)}
        assert address not in seen and len(seen) == 2
        back = replicas[dead] = start_replica(replicas[dead].events, port=replicas[dead].port)
        try:
            back.wait_ready()
            deadline = time.monotonic() + 10
            while router.metric("kvship_router:endpoint_healthy", address) != 1.0:
                assert time.monotonic() < deadline, router.picker_metrics()
                time.sleep(0.1)
            seen = [ask(router, SYSTEMS[1], f"Back {i}?", client) for i in range(3)]
        finally:
            back.stop(15)  # a process this test started ends with it
    assert all(r.status_code == 200 for r in seen), [r.text for r in seen]
    assert sorted(r.headers["x-kvship-endpoint"] for r in seen) == sorted(s.url.removeprefix("http://") for s in replicas)
