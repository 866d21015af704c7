"""The endpoints the picker chooses from, their load, and the scoring policies.

Load of an endpoint = the picks it was sent whose ext_proc stream is still open (exact, as the
picker sees it), plus requests waiting in its queue at the last /metrics scrape (traffic from
elsewhere). Running requests and KV usage only break ties: a scrape lags by an interval, and a
finished request still counted there would push a prefix off its replica under the load bound.

Where a prefix lives: what the engines report caching (their KV-cache events, `cached`:
kvship.router.kv_events), else the picker's own record of where it sent each prompt's blocks.

A request for a LoRA adapter goes preferably to an endpoint whose engine has it in a GPU slot
(running or waiting requests use it), else to one holding it loaded, among those within the load
bound; the policy then picks among them (GIE's LoRA-affinity scorer, by the same metric)."""
from __future__ import annotations

import ipaddress
import itertools
import math
import socket
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlsplit

POLICIES = ("prefix", "least-load", "round-robin")


@dataclass(frozen=True)
class Adapters:
    held: frozenset[str]  # loaded in the engine (its /v1/models)
    active: frozenset[str]  # used by its running or waiting requests: in a GPU slot


@dataclass
class Endpoint:
    address: str  # "ip:port", as Envoy's ORIGINAL_DST cluster dials it
    url: str  # base URL, for /metrics
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    last_scrape: float = 0.0
    adapters: Adapters = Adapters(frozenset(), frozenset())

    @property
    def load(self) -> float:
        return self.waiting + self.in_flight


def endpoint_from_url(url: str) -> Endpoint:
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"endpoint needs a host and a port: {url!r}")
    host = parts.hostname
    try:  # Envoy dials addresses, not names: resolve once, at start
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = socket.getaddrinfo(host, parts.port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            raise ValueError(f"cannot resolve endpoint host {parts.hostname!r}: {exc}") from exc
    address = f"[{host}]:{parts.port}" if ":" in host else f"{host}:{parts.port}"
    return Endpoint(address=address, url=f"{parts.scheme}://{address}")


@dataclass
class Pick:
    endpoint: Endpoint
    fallbacks: list[Endpoint]
    # prefix-cached (the engine reported the blocks), prefix-hit (the picker sent them there),
    # prefix-miss, prefix-overload, least-load, round-robin
    reason: str


class PrefixIndex:
    """Per endpoint, the block hashes of prompts it was sent (LRU, bounded): where a prefix's KV lives."""

    def __init__(self, max_blocks_per_endpoint: int = 100_000):
        self._max = max_blocks_per_endpoint
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, address: str, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` this endpoint holds."""
        held = self._blocks.get(address)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, address: str, hashes: list[bytes]) -> None:
        held = self._blocks.setdefault(address, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self._max:
            held.popitem(last=False)

    def forget(self, address: str) -> None:
        self._blocks.pop(address, None)


class Pool:
    """Thread-safe: the gRPC handlers pick while the scraper updates load and health."""

    def __init__(self, endpoints: list[Endpoint], policy: str = "prefix", load_epsilon: float = 0.25,
                 max_fallbacks: int = 2, cached=None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.endpoints = endpoints
        self.policy = policy
        self.epsilon = load_epsilon
        self.max_fallbacks = max_fallbacks
        self.index = PrefixIndex()
        self.cached = cached  # the engines' reported blocks (kv_events.CachedBlocks), or None
        self._rr = itertools.count()
        self.lock = threading.Lock()
        self.became_ready = threading.Condition(self.lock)  # notified when an endpoint turns healthy

    def healthy(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.healthy]

    def pick(self, block_hashes: list[bytes], cached_hashes: list | None = None,
             model: str | None = None) -> Pick | None:
        """`block_hashes`: the prompt text's blocks; `cached_hashes`: its token blocks as the engines
        hash them (kv_events.request_block_hashes), scored against what they report caching;
        `model`: the request's, for adapter affinity."""
        with self.lock:
            everyone = self.healthy()
            if not everyone:
                return None
            live = self._adapter_affinity(everyone, model)
            if self.policy == "round-robin":
                chosen, reason = live[next(self._rr) % len(live)], "round-robin"
            elif self.policy == "least-load":
                chosen, reason = min(live, key=self._load_key), "least-load"
            else:
                chosen, reason = self._pick_prefix(live, block_hashes, cached_hashes)
            self.index.record(chosen.address, block_hashes)
            chosen.in_flight += 1
            rest = sorted((e for e in everyone if e is not chosen), key=self._load_key)
            return Pick(chosen, rest[:self.max_fallbacks], reason)

    def done(self, endpoint: Endpoint) -> None:
        with self.lock:
            endpoint.in_flight = max(0, endpoint.in_flight - 1)

    def _within_bound(self, live: list[Endpoint]) -> list[Endpoint]:
        """Bounded load (consistent hashing with bounded loads): an endpoint takes a request only while
        its load + 1 stays within (1 + epsilon) x the mean load counting this request."""
        cap = math.ceil((1 + self.epsilon) * (sum(e.load for e in live) + 1) / len(live))
        return [e for e in live if e.load + 1 <= cap]

    def _adapter_affinity(self, live: list[Endpoint], model: str | None) -> list[Endpoint]:
        if not model:
            return live
        room = self._within_bound(live)
        for has in (lambda e: model in e.adapters.active, lambda e: model in e.adapters.held):
            holders = [e for e in room if has(e)]
            if holders:
                return holders
        return live

    @staticmethod
    def _load_key(e: Endpoint) -> tuple:
        return (e.load, e.kv_usage, e.running, e.address)

    def _matches(self, live: list[Endpoint], hashes: list[bytes], cached_hashes: list | None) -> tuple[list, str]:
        """(leading blocks held, endpoint) per endpoint: from the engines' reports when any holds
        some of this prompt, else from the picker's own record (blocks in flight count there)."""
        if cached_hashes and self.cached is not None:
            found = [(self.cached.match(e.address, cached_hashes), e) for e in live]
            if any(n for n, _ in found):
                return found, "prefix-cached"
        return [(self.index.match(e.address, hashes), e) for e in live], "prefix-hit"

    def _pick_prefix(self, live: list[Endpoint], hashes: list[bytes], cached_hashes: list | None) -> tuple[Endpoint, str]:
        room = self._within_bound(live) or live
        matches, hit = self._matches(live, hashes, cached_hashes)
        scored = sorted(matches, key=lambda t: -t[0])
        best_match = scored[0][0] if scored else 0
        if best_match:
            for n, e in scored:
                if n == best_match and e in room:
                    return e, hit
            # The holders are over the bound: the least loaded with room, which will hold it from now on.
            return min(room, key=self._load_key), "prefix-overload"
        # A prefix seen nowhere: least loaded, ties broken by the first block's hash so that
        # concurrent new prefixes spread instead of all landing on the first endpoint.
        seed = zlib.crc32(hashes[0]) if hashes else 0
        least = min(e.load for e in room)
        tied = [e for e in room if e.load == least]
        return tied[seed % len(tied)], "prefix-miss"

    def update(self, endpoint: Endpoint, metrics: dict[str, float] | None, adapters: Adapters | None = None) -> None:
        with self.lock:
            endpoint.adapters = adapters or Adapters(frozenset(), frozenset())
            if metrics is None:
                if endpoint.healthy:
                    self.index.forget(endpoint.address)  # a restarted engine holds nothing
                    if self.cached is not None:
                        self.cached.forget(endpoint.address)
                endpoint.healthy = False
                return
            if not endpoint.healthy:
                self.became_ready.notify_all()
            endpoint.healthy = True
            endpoint.running = metrics.get("kvship:num_requests_running", 0.0)
            endpoint.waiting = metrics.get("kvship:num_requests_waiting", 0.0)
            endpoint.kv_usage = metrics.get("kvship:kv_cache_usage_perc", 0.0)
            endpoint.last_scrape = time.monotonic()
