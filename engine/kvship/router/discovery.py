"""Endpoints from a DNS name (`--discover HOST:PORT`): every address the name resolves to, read
again every interval. In Kubernetes the name is a headless Service of the ready replicas, so
the pool follows scaling (from zero included) and restarts without the picker restarting."""
from __future__ import annotations

import logging
import socket
import threading

from kvship.router.pool import Endpoint, Pool

logger = logging.getLogger("kvship.router")


def parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--discover needs HOST:PORT, got {target!r}")
    return host, int(port)


def resolve(host: str, port: int) -> list[str]:
    """Every address of ``host`` as "ip:port" (sorted); none while the name does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]


def set_addresses(pool: Pool, addresses: list[str]) -> tuple[list[str], list[str]]:
    """Make the pool's endpoints exactly ``addresses``, keeping the ones already there (their
    load and prefix index). A new endpoint waits for its first good scrape before it is picked.
    Returns (added, removed)."""
    with pool.lock:
        current = {e.address: e for e in pool.endpoints}
        added = [a for a in addresses if a not in current]
        removed = [a for a in current if a not in addresses]
        for address in removed:
            pool.index.forget(address)
        # a new list, never mutated in place: the scraper iterates the one it read
        pool.endpoints = [current.get(a) or Endpoint(address=a, url=f"http://{a}", healthy=False) for a in addresses]
    return added, removed


class Discovery:
    def __init__(self, pool: Pool, target: str, interval_s: float = 2.0):
        self.pool = pool
        self.host, self.port = parse_target(target)
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvship-router-discovery", daemon=True)

    def refresh(self) -> None:
        added, removed = set_addresses(self.pool, resolve(self.host, self.port))
        if added or removed:
            logger.info("discovered %s: +%s -%s", self.host, added, removed)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
