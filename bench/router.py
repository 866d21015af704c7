"""`kvship router` on the CPU: 3 replicas of the bundled model behind Envoy + the endpoint picker,
a multi-tenant workload (several long shared system prompts, short user turns, interleaved).
Per policy: TTFT p50/p99 (streamed) and the replicas' prefix-cache hit rate over the run, beside
one replica alone (every prefix cached in one place, the ceiling); `prefix + KV events` scores
what the replicas report caching. Then the Envoy + picker hop's own added latency: GET /health
straight to a replica against the same through the router, and the /tokenize round trip the
KV-event scoring adds to a request.

    python bench/router.py [--replicas 3] [--tenants 5] [--turns 4] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "router"))
from common import header, table
from router_utils import RouterProcess  # noqa: E402  (tests/router: the same process wrapper)
from server_utils import ServerProcess, free_port

SERVE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "2")


def workload(tenants: int, turns: int) -> list[tuple[str, str]]:
    systems = [f"You are the assistant of company {t}. " + f"Company {t} handbook, section {t}: be brief. " * 30
               for t in range(tenants)]
    return [(systems[t], f"Turn {k}: what is rule {k}?") for k in range(turns) for t in range(tenants)]


async def run_load(url: str, model: str, requests: list[tuple[str, str]], concurrency: int) -> list[float]:
    ttfts: list[float] = []
    queue = list(requests)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            system, user = queue.pop(0)
            t0 = time.perf_counter()
            async with client.stream("POST", url + "/v1/chat/completions", timeout=300, json={
                    "model": model, "max_tokens": 2, "stream": True, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}) as r:
                r.raise_for_status()
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.perf_counter() - t0
                ttfts.append(first if first is not None else time.perf_counter() - t0)

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return ttfts


def hit_rate(servers: list[ServerProcess], before: list[dict]) -> float:
    after = [s.metrics() for s in servers]
    hits = sum(a["kvship:prefix_cache_hits_total"] - b["kvship:prefix_cache_hits_total"] for a, b in zip(after, before))
    queries = sum(a["kvship:prefix_cache_queries_total"] - b["kvship:prefix_cache_queries_total"]
                  for a, b in zip(after, before))
    return hits / queries if queries else 0.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def median_ms(call, n: int = 300) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def hop_latency(direct: str, routed: str) -> tuple[float, float]:
    with httpx.Client() as c:
        return tuple(median_ms(lambda url=url: c.get(url + "/health").raise_for_status()) for url in (direct, routed))


def tokenize_latency(url: str, model: str, system: str) -> float:
    body = {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    with httpx.Client() as c:
        return median_ms(lambda: c.post(url + "/tokenize", json=body).raise_for_status(), n=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    # Not a multiple of --replicas: round-robin over tenants in turn would be sticky by accident.
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    requests = workload(args.tenants, args.turns)
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.replicas)]
    servers = [ServerProcess(*SERVE_ARGS, "--kv-events-config",
                             json.dumps({"enable_kv_cache_events": True, "endpoint": e})) for e in events]
    routers: list[RouterProcess] = []
    try:
        for s in servers:
            s.wait_ready()
        model = httpx.get(servers[0].url + "/v1/models").json()["data"][0]["id"]
        rows = []
        # One replica alone, fresh (its cache empty): the hit-rate ceiling for this workload.
        solo = ServerProcess(*SERVE_ARGS)
        try:
            solo.wait_ready()
            before = [solo.metrics()]
            ttft = asyncio.run(run_load(solo.url, model, requests, args.concurrency))
            rows.append(["one replica alone", f"{pct(ttft, .5):.0f}", f"{pct(ttft, .99):.0f}",
                         f"{hit_rate([solo], before):.0%}"])
        finally:
            solo.stop(15)
        setups = {"prefix": ("prefix",), "prefix + KV events": ("prefix", *(a for e in events for a in ("--kv-events", e))),
                  "least-load": ("least-load",), "round-robin": ("round-robin",)}
        for policy, router_args in setups.items():
            router = RouterProcess([s.url for s in servers], *router_args)
            routers.append(router)
            router.wait_ready()
            # Each policy sees prefixes no replica holds yet: a distinct tenant text per policy.
            reqs = [(f"[{policy}] " + sys_, user) for sys_, user in requests]
            before = [s.metrics() for s in servers]
            ttft = asyncio.run(run_load(router.url, model, reqs, args.concurrency))
            rows.append([f"router, {policy}", f"{pct(ttft, .5):.0f}", f"{pct(ttft, .99):.0f}",
                         f"{hit_rate(servers, before):.0%}"])
        direct, routed = hop_latency(servers[0].url, routers[0].url)
        tokenize = tokenize_latency(servers[0].url, model, requests[0][0])
        print(header(f"kvship router: {args.replicas} replicas, {args.tenants} tenants x {args.turns} turns, "
                     f"concurrency {args.concurrency}"))
        print(table(rows, ["setup", "TTFT p50 ms", "TTFT p99 ms", "prefix-cache hit rate"]))
        print()
        print(table([[f"{direct:.2f}", f"{routed:.2f}", f"{routed - direct:.2f}", f"{tokenize:.2f}"]],
                    ["GET /health direct p50 ms", "through Envoy + picker p50 ms", "added ms",
                     "KV events: /tokenize p50 ms"]))
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop(15)


if __name__ == "__main__":
    main()
