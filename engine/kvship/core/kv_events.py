"""KV-cache events, published as vLLM publishes them (`--kv-events-config`), so that tools
written for vLLM's events (an endpoint picker's prefix index, llm-d's KV-cache indexer) read
kvship's: a ZMQ PUB socket sends each step's events as one multipart message [topic, sequence
number (8 bytes, big-endian), msgpack batch]. The batch is msgspec's array form of vLLM's
structs: [ts, [event, ...]], each event an array whose first item names it:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A block's hash (an int) chains its tokens on the hash of the block before (`block_hash`)."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvship.config import KVEventsConfig

log = logging.getLogger(__name__)


# Stands for "no parent" inside the hash: None's own hash is its address before Python 3.12.
_ROOT = 0x6B76736869700000


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix cache's key for a full block: the same in every process (a tuple of ints hashes
    alike everywhere), so a subscriber can compute it from a prompt's tokens."""
    return hash((_ROOT if parent is None else parent, tuple(tokens)))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of `token_ids`."""
    out: list[int] = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        out.append(block_hash(out[-1] if out else None, token_ids[i:i + block_size]))
    return out


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
           lora_id: int | None = None) -> list:
    return ["BlockStored", hashes, parent, token_ids, block_size, lora_id, None]


def removed(hashes: list[int]) -> list:
    return ["BlockRemoved", hashes, None]


ALL_CLEARED = ["AllBlocksCleared"]


class ZmqEventPublisher:
    """Binds at start, so subscribers may connect before the first event; sends never block (a
    subscriber that falls behind the high-water mark loses batches, as with vLLM)."""

    def __init__(self, config: KVEventsConfig):
        import msgpack
        import zmq

        self._pack = msgpack.Packer().pack
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        self._sock.bind(config.endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self.seq = 0
        log.info("publishing KV-cache events on %s", self.endpoint)

    def publish(self, events: list[list]) -> None:
        if not events:
            return
        payload = self._pack([time.time(), events])
        try:
            self._sock.send_multipart([self._topic, self.seq.to_bytes(8, "big"), payload], self._zmq.NOBLOCK)
        except self._zmq.Again:
            log.warning("KV-cache event batch %d dropped: the socket's queue is full", self.seq)
        self.seq += 1

    def close(self) -> None:
        """Tells subscribers the cache is gone, then closes (a moment to send that last batch)."""
        self.publish([ALL_CLEARED])
        self._sock.close(linger=200)
        self._ctx.term()


def open_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    return ZmqEventPublisher(config) if config is not None and config.publishing else None
