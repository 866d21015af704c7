"""Bring each ready replica's LoRA adapters to spec.adapters without a restart: read what it
holds (/v1/models, adapters are the cards with a parent), unload what the spec dropped, load
what it added (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter). A load the engine
refuses is reported per replica in status.adapters, and tried again at the next pass."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from . import adapters as ad
from . import metrics_client as mc

LOAD_TIMEOUT = 300.0  # a hub or URL adapter is downloaded while the request waits


def _post(address: str, path: str, body: dict[str, Any], timeout: float) -> None:
    req = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout):  # noqa: S310 - http to a pod
        pass


def _why(e: Exception) -> str:
    """The engine's OpenAI-shaped error message, else the exception."""
    if isinstance(e, urllib.error.HTTPError):
        try:
            return f"{e.code}: {json.loads(e.read().decode())['error']['message']}"
        except (ValueError, KeyError, TypeError):
            return f"HTTP {e.code}"
    return str(e)


def sync_replica(address: str, want: dict[str, str], timeout: float = LOAD_TIMEOUT) -> dict[str, Any]:
    """Load and unload until the engine at ``address`` holds ``want`` (name -> lora_path);
    {"adapters": what it holds afterwards, "message": the failures, if any}."""
    have = ad.held(mc.fetch_model_cards(address))
    todo = ad.plan(want, have)
    problems: list[str] = []
    for name in todo.unload:
        try:
            _post(address, "/v1/unload_lora_adapter", {"lora_name": name}, timeout)
            have.pop(name, None)
        except (OSError, urllib.error.URLError) as e:
            problems.append(f"unload {name}: {_why(e)}")
    for name, path in todo.load:
        try:
            _post(address, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout)
            have[name] = path
        except (OSError, urllib.error.URLError) as e:
            problems.append(f"load {name} from {path}: {_why(e)}")
    out: dict[str, Any] = {"adapters": sorted(have)}
    if problems:
        out["message"] = "; ".join(problems)
    return out


def sync(pods: list[dict[str, Any]], want: dict[str, str], pod_address: Optional[mc.PodAddress],
         timeout: float = LOAD_TIMEOUT) -> list[dict[str, Any]]:
    """status.adapters: one entry per ready pod (in parallel), in pod-name order."""
    ready = sorted((p for p in pods if mc.is_ready(p)), key=lambda p: p["metadata"]["name"])
    address_of = pod_address or mc.pod_ip_address

    def one(pod: dict[str, Any]) -> dict[str, Any]:
        name = pod["metadata"]["name"]
        address = address_of(pod)
        if address is None:
            return {"replica": name, "adapters": [], "message": "no pod IP"}
        try:
            return {"replica": name, **sync_replica(address, want, timeout)}
        except (OSError, ValueError, KeyError, urllib.error.URLError) as e:
            return {"replica": name, "adapters": [], "message": f"{address}: {_why(e)}"}

    if not ready:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(ready))) as pool:
        return list(pool.map(one, ready))
