"""`kvship router` on the CPU: 3 replicas of the bundled model behind Envoy + the endpoint picker,
a multi-tenant workload (several long shared system prompts, short user turns, interleaved).
Per policy: TTFT p50/p99 (streamed) and the replicas' prefix-cache hit rate over the run, beside
one replica alone (every prefix cached in one place, the ceiling). Then the Envoy + picker hop's
own added latency: GET /health straight to a replica against the same through the router.

    python bench/router.py [--replicas 3] [--tenants 5] [--turns 4] [--concurrency 4]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "router"))
from common import header, table
from server_utils import ServerProcess
from test_envoy import RouterProcess  # noqa: E402  (tests/router: the same process wrapper)

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


def hop_latency(direct: str, routed: str, n: int = 300) -> tuple[float, float]:
    out = []
    for url in (direct, routed):
        with httpx.Client() as c:
            for _ in range(20):
                c.get(url + "/health")
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.get(url + "/health").raise_for_status()
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times) * 1000)
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    # Not a multiple of --replicas: round-robin over tenants in turn would be sticky by accident.
    ap.add_argument("--tenants", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    requests = workload(args.tenants, args.turns)
    servers = [ServerProcess(*SERVE_ARGS) for _ in range(args.replicas)]
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
        for policy in ("prefix", "least-load", "round-robin"):
            router = RouterProcess([s.url for s in servers], policy)
            routers.append(router)
            router.wait_ready()
            # Each policy sees prefixes no replica holds yet: a distinct tenant text per policy.
            reqs = [(f"[{policy}] " + sys_, user) for sys_, user in requests]
            before = [s.metrics() for s in servers]
            ttft = asyncio.run(run_load(router.url, model, reqs, args.concurrency))
            rows.append([f"router, {policy}", f"{pct(ttft, .5):.0f}", f"{pct(ttft, .99):.0f}",
                         f"{hit_rate(servers, before):.0%}"])
        direct, routed = hop_latency(servers[0].url, routers[0].url)
        print(header(f"kvship router: {args.replicas} replicas, {args.tenants} tenants x {args.turns} turns, "
                     f"concurrency {args.concurrency}"))
        print(table(rows, ["setup", "TTFT p50 ms", "TTFT p99 ms", "prefix-cache hit rate"]))
        print()
        print(table([[f"{direct:.2f}", f"{routed:.2f}", f"{routed - direct:.2f}"]],
                    ["GET /health direct p50 ms", "through Envoy + picker p50 ms", "added ms"]))
    finally:
        for r in routers:
            r.stop()
        for s in servers:
            s.stop(15)


if __name__ == "__main__":
    main()
