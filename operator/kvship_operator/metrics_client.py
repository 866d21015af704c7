"""Scrape the engine's queue depth from each ready pod's `/metrics` (Prometheus text).

The load of a pod is ``kvship:num_requests_waiting + kvship:num_requests_running`` (summed
over label sets). A pod is scraped at ``http://<podIP>:8000/metrics`` with a short time
limit; a pod that does not answer is left out of the sum (and reported), never guessed.
Where a pod is reached is a function passed in (``pod_ip_address`` in a cluster), so that
tests without kubelets can point pods at servers on loopback.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from . import router_builders as rb
from . import spec as s
from .builders import ROUTER_APP

WAITING = "kvship:num_requests_waiting"
RUNNING = "kvship:num_requests_running"
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


def is_ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pod_ip_address(pod: dict[str, Any]) -> Optional[str]:
    """host:port of a pod's /metrics in a cluster (an engine's, or a router's: spec.routing);
    None before the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    labels = (pod.get("metadata") or {}).get("labels") or {}
    router = labels.get("app.kubernetes.io/name") == ROUTER_APP
    return f"{ip}:{rb.METRICS_PORT if router else s.ENGINE_PORT}" if ip else None


PodAddress = Callable[[dict[str, Any]], Optional[str]]


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
           pod_address: PodAddress = pod_ip_address) -> Scrape:
    """Load of every ready pod, scraped in parallel."""
    ready = [p for p in pods if is_ready(p)]
    out = Scrape(total=None)
    if not ready:
        return out
    targets: dict[str, Optional[str]] = {p["metadata"]["name"]: pod_address(p) for p in ready}

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


def fetch_model_cards(address: str, timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]]:
    """An engine's OpenAI /v1/models cards (LoRA adapters among them, with a ``parent``)."""
    import json

    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=timeout) as resp:  # noqa: S310
        data = json.loads(resp.read().decode("utf-8", "replace"))
    return [m for m in data.get("data") or [] if m.get("id")]


def fetch_models(address: str, timeout: float = DEFAULT_TIMEOUT) -> list[str]:
    """The base model names an engine serves (adapters left out: status.adapters lists them)."""
    return [str(m["id"]) for m in fetch_model_cards(address, timeout) if not m.get("parent")]


def served_models(pods: list[dict[str, Any]], pod_address: Optional[PodAddress],
                  timeout: float = DEFAULT_TIMEOUT) -> dict[str, str]:
    """pod name -> the model it serves, for every ready pod: what the engine answers on
    /v1/models, else (not reachable from here) the --served-model-name it was started with."""
    ready = [p for p in pods if is_ready(p)]

    def one(pod: dict[str, Any]) -> tuple[str, str]:
        name = pod["metadata"]["name"]
        address = pod_address(pod) if pod_address else None
        if address:
            try:
                models = fetch_models(address, timeout)
                if models:
                    return name, ",".join(models)
            except (OSError, ValueError, KeyError, urllib.error.URLError):
                pass
        return name, started_with(pod) or "unknown"

    if not ready:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(ready))) as pool:
        return dict(pool.map(one, ready))


def started_with(pod: dict[str, Any]) -> Optional[str]:
    """The --served-model-name in a pod's engine arguments."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        args = list(c.get("args") or [])
        if c.get("name") == "engine" and "--served-model-name" in args[:-1]:
            return args[args.index("--served-model-name") + 1]
    return None
