"""Scale from zero and back to it (spec.autoscaling.minReplicas 0, with a router): pure decisions
and the router's signal.

At zero replicas only the router sees demand. Its /metrics says so twice: the requests it holds
for want of a replica (``PENDING_METRIC``, a gauge) and the requests it had to refuse for want of
one (picks with reason ``no-endpoint``, ``hold-timeout`` or ``hold-full``, a counter: 503 with
Retry-After, which a client retries).
Either brings the first replica up. The last one goes once nothing ran, waited or was held for
``idle_seconds``; missing engine metrics count as activity (a replica still starting is not idle).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from . import autoscaler as asc
from . import metrics_client
from .builders import ROUTER_PENDING_METRIC as PENDING_METRIC

PICKS_METRIC = "kvship_router:picks_total"
# a request answered 503 for want of a ready replica: none at all, the hold timed out, the hold was full
REFUSED = ('reason="no-endpoint"', 'reason="hold-timeout"', 'reason="hold-full"')


@dataclass(frozen=True)
class RouterSignal:
    pending: float  # requests held now, over the router pods
    refused: float  # no-endpoint picks so far (a counter, summed over the router pods)


def parse_router(text: str) -> RouterSignal:
    pending = refused = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        if name == PENDING_METRIC:
            pending += value
        elif name == PICKS_METRIC and any(reason in line for reason in REFUSED):
            refused += value
    return RouterSignal(pending, refused)


def read_routers(pods: list[dict[str, Any]], pod_address: metrics_client.PodAddress,
                 timeout: float = metrics_client.DEFAULT_TIMEOUT) -> Optional[RouterSignal]:
    """The signal summed over the ready router pods that answered; None when none did."""
    total: Optional[RouterSignal] = None
    for pod in pods:
        address = pod_address(pod) if metrics_client.is_ready(pod) else None
        if address is None:
            continue
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:  # noqa: S310
                one = parse_router(resp.read().decode("utf-8", "replace"))
        except (OSError, ValueError, urllib.error.URLError):
            continue
        total = one if total is None else RouterSignal(total.pending + one.pending, total.refused + one.refused)
    return total


def decide(state: asc.Autoscaler, now: float, current: int, load: Optional[float],
           router: Optional[RouterSignal], idle_seconds: float) -> Optional[asc.Decision]:
    """The decision at or towards zero, or None: the regular autoscaler decides (current >= 1
    and not idle long enough). Always a decision at zero, so the lower bound of 1 that the
    regular autoscaler keeps never brings a replica up without demand."""
    refused_now = router.refused if router is not None else None
    new_refusals = (refused_now is not None and state.router_refused is not None
                    and refused_now > state.router_refused)
    if refused_now is not None:
        state.router_refused = refused_now  # a restarted router counts from 0 again: the baseline follows
    held = router.pending if router is not None else 0.0
    if current == 0:
        if held > 0 or new_refusals:
            state.last_busy = now
            why = f"{held:g} request(s) held by the router" if held > 0 else "the router refused requests"
            return asc.Decision(1, 1, load, "ScaleFromZero", f"{why} with no replica; scaling 0 -> 1")
        return asc.Decision(0, 0, load, "Idle", "no replica and no request; the router brings one up on demand")
    busy = load is None or load > 0 or held > 0 or new_refusals
    if busy or state.last_busy is None:  # None: a fresh operator starts the idle window now
        state.last_busy = now
        return None
    if now - state.last_busy < idle_seconds:
        return None
    return asc.Decision(0, 0, load, "ScaleToZero",
                        f"no request for {idle_seconds:g} s; scaling {current} -> 0 (the router holds the next)")
