"""Each engine's /metrics, read every interval: queue depth, running requests, KV-cache usage (the
GIE model-server protocol's signals, under kvship's names). A failed scrape takes the endpoint out."""
from __future__ import annotations

import logging
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvship.router.pool import Endpoint, Pool

logger = logging.getLogger("kvship.router")

WANTED = ("kvship:num_requests_running", "kvship:num_requests_waiting", "kvship:kv_cache_usage_perc")


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in WANTED:
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def scrape(endpoint: Endpoint, timeout: float) -> dict[str, float] | None:
    try:
        with urllib.request.urlopen(endpoint.url + "/metrics", timeout=timeout) as resp:
            return parse_metrics(resp.read().decode(errors="replace"))
    except (OSError, ValueError):
        return None


class Scraper:
    def __init__(self, pool: Pool, interval_s: float = 0.5):
        self.pool = pool
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvship-router-scrape", daemon=True)
        # threads start only as needed; discovered endpoints may outnumber those given at start
        self._workers = ThreadPoolExecutor(16, thread_name_prefix="kvship-scrape")

    def scrape_once(self) -> None:
        timeout = max(0.2, self.interval * 2)
        results = list(self._workers.map(lambda e: (e, scrape(e, timeout)), self.pool.endpoints))
        for endpoint, metrics in results:
            was = endpoint.healthy
            self.pool.update(endpoint, metrics)
            if was != endpoint.healthy:
                logger.info("endpoint %s is %s", endpoint.address, "up" if endpoint.healthy else "down")

    def start(self) -> None:
        self.scrape_once()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.scrape_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._workers.shutdown(wait=True, cancel_futures=True)
