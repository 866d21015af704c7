"""Each engine's /metrics, read every interval: queue depth, running requests, KV-cache usage (the
GIE model-server protocol's signals, under kvship's names). A refused or failed scrape takes the
endpoint out; a slow one only after MAX_SLOW in a row (a busy engine answers late, and taking it
out forgets where its prefixes live).
An engine serving LoRA adapters (it exports `kvship:lora_requests_info`) is also asked which it
holds (/v1/models: the cards with a parent), for the picker's adapter affinity."""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvship.router.pool import Adapters, Endpoint, Pool

logger = logging.getLogger("kvship.router")

MAX_SLOW = 3  # scrapes in a row that time out before the endpoint is taken out
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


LORA_INFO = "kvship:lora_requests_info"  # vLLM's name and labels, which GIE's LoRA scorer reads


def parse_lora_info(text: str) -> frozenset[str] | None:
    """Adapters of running and waiting requests (in GPU slots); None: the engine serves no adapters."""
    from prometheus_client.parser import text_string_to_metric_families

    lines = "\n".join(line for line in text.splitlines() if line.startswith(LORA_INFO))
    if not lines:
        return None
    active: set[str] = set()
    try:  # only these lines: a surprise elsewhere in the page must not cost the endpoint its health
        for family in text_string_to_metric_families(lines + "\n"):
            for sample in family.samples:
                for key in ("running_lora_adapters", "waiting_lora_adapters"):
                    active.update(n for n in sample.labels.get(key, "").split(",") if n)
    except ValueError:
        pass
    return frozenset(active)


def held_adapters(endpoint: Endpoint, timeout: float) -> frozenset[str]:
    with urllib.request.urlopen(endpoint.url + "/v1/models", timeout=timeout) as resp:
        cards = json.loads(resp.read().decode(errors="replace")).get("data") or []
    return frozenset(str(c["id"]) for c in cards if c.get("parent") and c.get("id"))


def timed_out(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, TimeoutError))


def scrape(endpoint: Endpoint, timeout: float) -> tuple[dict[str, float] | None, Adapters | None, bool]:
    """(metrics, adapters, slow): metrics None when the scrape failed, slow when it timed out."""
    try:
        with urllib.request.urlopen(endpoint.url + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode(errors="replace")
        active = parse_lora_info(text)
        adapters = None if active is None else Adapters(held_adapters(endpoint, timeout) | active, active)
        return parse_metrics(text), adapters, False
    except (OSError, ValueError, KeyError) as exc:
        return None, None, timed_out(exc)


class Scraper:
    def __init__(self, pool: Pool, interval_s: float = 0.5):
        self.pool = pool
        self.interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvship-router-scrape", daemon=True)
        # threads start only as needed; discovered endpoints may outnumber those given at start
        self._workers = ThreadPoolExecutor(16, thread_name_prefix="kvship-scrape")
        self._slow: dict[str, int] = {}  # address -> scrapes in a row that timed out

    def scrape_once(self) -> None:
        timeout = max(0.2, self.interval * 2)
        results = list(self._workers.map(lambda e: (e, scrape(e, timeout)), self.pool.endpoints))
        for endpoint, (metrics, adapters, slow) in results:
            self._slow[endpoint.address] = self._slow.get(endpoint.address, 0) + 1 if slow else 0
            if 0 < self._slow[endpoint.address] < MAX_SLOW:
                continue  # the last reading stands
            was = endpoint.healthy
            self.pool.update(endpoint, metrics, adapters)
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
