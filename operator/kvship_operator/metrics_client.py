"""Scrape the engine's queue depth from each ready pod's `/metrics` (Prometheus text).

The load of a pod is ``kvship:num_requests_waiting + kvship:num_requests_running`` (summed
over label sets). A pod is scraped at ``http://<podIP>:8000/metrics`` with a short time
limit; a pod that does not answer is left out of the sum (and reported), never guessed.

**For tests only**: the environment variable ``KVSHIP_AUTOSCALER_POD_ADDRESSES`` (a JSON
object ``{"<namespace>/<pod>": "host:port", ...}``) sends the scrape for those pods to
another address instead of the pod IP. The operator tests run without kubelets, so no pod
has an IP; real `kvship serve` processes on loopback stand in for them through this map.
It may also name a file (``@/path/to/map.json``), re-read on every scrape so a test can add
pods as they appear. Leave it unset in a real cluster.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import spec as s

WAITING = "kvship:num_requests_waiting"
RUNNING = "kvship:num_requests_running"
ADDRESS_OVERRIDE_ENV = "KVSHIP_AUTOSCALER_POD_ADDRESSES"
DEFAULT_TIMEOUT = 2.0


def parse_load(text: str) -> Optional[float]:
    """waiting + running from a Prometheus text exposition; None when neither is present."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (WAITING, RUNNING):
            try:
                rest = line.rsplit("}", 1)[-1] if "{" in line else line[len(name):]
                value = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
            total += value
            seen = True
    return total if seen else None


def address_overrides(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test-only pod -> host:port map (see the module docstring)."""
    raw = (os.environ if env is None else env).get(ADDRESS_OVERRIDE_ENV, "").strip()
    if not raw:
        return {}
    if raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as f:
                raw = f.read()
        except OSError:
            return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def is_ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pod_address(pod: dict[str, Any], overrides: Mapping[str, str]) -> Optional[str]:
    meta = pod.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    if key in overrides:
        return overrides[key]
    ip = (pod.get("status") or {}).get("podIP")
    return f"{ip}:{s.ENGINE_PORT}" if ip else None


@dataclass
class Scrape:
    total: Optional[float]  # None: no ready pod answered
    per_pod: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # pod -> why

    @property
    def ready(self) -> int:
        return len(self.per_pod) + len(self.failed)


def fetch_load(address: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    url = f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - http to a pod
        text = resp.read().decode("utf-8", "replace")
    load = parse_load(text)
    if load is None:
        raise ValueError(f"{url} has no {WAITING} / {RUNNING}")
    return load


def scrape(pods: list[dict[str, Any]], *, timeout: float = DEFAULT_TIMEOUT,
           overrides: Mapping[str, str] | None = None) -> Scrape:
    """Load of every ready pod, scraped in parallel."""
    overrides = address_overrides() if overrides is None else overrides
    ready = [p for p in pods if is_ready(p)]
    out = Scrape(total=None)
    if not ready:
        return out
    targets: dict[str, Optional[str]] = {p["metadata"]["name"]: pod_address(p, overrides) for p in ready}

    def one(item: tuple[str, Optional[str]]) -> tuple[str, Any]:
        name, address = item
        if address is None:
            return name, "no pod IP"
        try:
            return name, fetch_load(address, timeout)
        except (OSError, ValueError, urllib.error.URLError) as e:
            return name, f"{address}: {e}"

    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        for name, result in pool.map(one, targets.items()):
            if isinstance(result, float):
                out.per_pod[name] = result
            else:
                out.failed[name] = str(result)
    if out.per_pod:
        out.total = sum(out.per_pod.values())
    return out
