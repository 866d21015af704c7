"""What each engine actually caches, from its KV-cache events (vLLM's format: ZMQ PUB, msgpack
batches of BlockStored / BlockRemoved / AllBlocksCleared; kvship.core.kv_events publishes them).

One thread subscribes to every endpoint's events and keeps, per endpoint, the set of block
hashes it holds. To score a request against it, the picker needs the request's tokens as the
engine makes them (chat template included): it asks an engine's /tokenize, then chains the
block hashes as the engine does. ZMQ reconnects by itself to an engine that restarts."""
from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable

from kvship.core.kv_events import block_hashes
from kvship.router.pool import Endpoint
from kvship.router.prompt import ParsedRequest

logger = logging.getLogger("kvship.router")


class CachedBlocks:
    """Per endpoint address, the block hashes its engine reported stored and not yet removed."""

    def __init__(self, max_blocks_per_endpoint: int = 1_000_000):
        self._max = max_blocks_per_endpoint
        self._blocks: dict[str, OrderedDict] = {}
        self.block_size: int | None = None  # from the first BlockStored
        self.lock = threading.Lock()

    def apply(self, address: str, events: list) -> None:
        with self.lock:
            held = self._blocks.setdefault(address, OrderedDict())
            for event in events:
                if not isinstance(event, list) or not event:
                    continue
                if event[0] == "BlockStored" and len(event) >= 5:
                    self.block_size = event[4]
                    for h in event[1]:
                        held[h] = None
                    while len(held) > self._max:  # events lost somewhere: forget the oldest
                        held.popitem(last=False)
                elif event[0] == "BlockRemoved" and len(event) >= 2:
                    for h in event[1]:
                        held.pop(h, None)
                elif event[0] == "AllBlocksCleared":
                    held.clear()

    def match(self, address: str, hashes: list) -> int:
        """Leading blocks of `hashes` this endpoint's engine holds."""
        with self.lock:
            held = self._blocks.get(address)
            n = 0
            while held and n < len(hashes) and hashes[n] in held:
                n += 1
            return n

    def count(self, address: str) -> int:
        with self.lock:
            return len(self._blocks.get(address, ()))

    def forget(self, address: str) -> None:
        with self.lock:
            self._blocks.pop(address, None)


class EventSubscriber:
    """A SUB socket per endpoint, read by one thread. `sources()` (endpoint address -> ZMQ
    address) is read again every second: endpoints that come (discovery, scaling) are
    subscribed to, those that go are closed and their blocks forgotten."""

    REFRESH_S = 1.0

    def __init__(self, blocks: CachedBlocks, sources: Callable[[], dict[str, str]], topic: str = ""):
        self.blocks = blocks
        self.sources = sources
        self.topic = topic.encode()
        self.batches = 0
        self.gaps = 0  # batches missed (a sequence number skipped): the index may hold stale blocks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvship-router-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        import msgpack
        import zmq

        ctx = zmq.Context()
        poller = zmq.Poller()
        sockets: dict = {}  # socket -> (endpoint address, ZMQ address)
        last_seq: dict[str, int] = {}
        refreshed = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() - refreshed >= self.REFRESH_S:
                    self._follow(ctx, poller, sockets, last_seq)
                    refreshed = time.monotonic()
                for sock, _ in poller.poll(200):
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                    address = sockets[sock][0]
                    try:
                        seq = int.from_bytes(parts[1], "big")
                        batch = msgpack.unpackb(parts[2], strict_map_key=False)
                        events = batch[1]
                    except (IndexError, TypeError, ValueError, msgpack.UnpackException) as exc:
                        logger.warning("unreadable KV-event message from %s: %s", address, exc)
                        continue
                    if address in last_seq and seq != last_seq[address] + 1 and seq != 0:
                        self.gaps += 1
                    last_seq[address] = seq
                    self.blocks.apply(address, events)
                    self.batches += 1
        finally:
            for sock in sockets:
                sock.close(0)
            ctx.term()

    def _follow(self, ctx, poller, sockets: dict, last_seq: dict) -> None:
        """Subscribe to the sources there now, close the ones gone (or moved)."""
        import zmq

        wanted = self.sources()
        for sock, (address, source) in list(sockets.items()):
            if wanted.get(address) != source:
                poller.unregister(sock)
                sock.close(0)
                del sockets[sock]
                last_seq.pop(address, None)
                self.blocks.forget(address)
        subscribed = {address for address, _ in sockets.values()}
        for address, source in wanted.items():
            if address not in subscribed:
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.connect(source)
                poller.register(sock, zmq.POLLIN)
                sockets[sock] = (address, source)


def request_block_hashes(parsed: ParsedRequest, blocks: CachedBlocks, live: list[Endpoint],
                         authorization: str | None = None, timeout_s: float = 2.0) -> list[int]:
    """The request's block hashes as an engine computes them, its tokens from an engine's
    /tokenize (with the request's own credentials, for an engine that wants an API key); []
    when that is not possible (no block size known yet, no engine, an error)."""
    if blocks.block_size is None or not live:
        return []
    tokens = parsed.token_ids
    if tokens is None:
        if parsed.tokenize is None:
            return []
        url = random.choice(live).url + "/tokenize"
        headers = {"content-type": "application/json"}
        if authorization:
            headers["authorization"] = authorization
        request = urllib.request.Request(url, json.dumps(parsed.tokenize).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                tokens = json.loads(resp.read())["tokens"]
        except (OSError, ValueError, KeyError) as exc:
            logger.debug("tokenize at %s failed: %s", url, exc)
            return []
    return block_hashes(tokens, blocks.block_size)
