"""Endpoints from the Kubernetes API (`--discover-k8s NAMESPACE/SERVICE:PORT`): the ready
addresses of the Service's EndpointSlices, listed then watched, as the
Gateway API Inference Extension's endpoint picker follows its pool. Needs no cluster DNS: the
in-cluster service account (or $KUBECONFIG) and get/list/watch on endpointslices suffice."""
from __future__ import annotations

import logging
import threading
from typing import Any

from kvship.router.discovery import set_addresses
from kvship.router.pool import Pool

logger = logging.getLogger("kvship.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by the EndpointSlice controller
# v1 from Kubernetes 1.21; the same fields read here in v1beta1 before it
SLICE_API_VERSIONS = ("discovery.k8s.io/v1", "discovery.k8s.io/v1beta1")


def parse_k8s_target(target: str) -> tuple[str, str, str]:
    """"NAMESPACE/SERVICE:PORT" -> (namespace, service, port); PORT is a number or a port name."""
    ns_service, sep, port = target.rpartition(":")
    namespace, slash, service = ns_service.partition("/")
    if not sep or not slash or not namespace or not service or not port or "/" in service:
        raise ValueError(f"--discover-k8s needs NAMESPACE/SERVICE:PORT (PORT a number or a port name), got {target!r}")
    return namespace, service, port


def _slice_port(endpoint_slice: dict[str, Any], port: str) -> int | None:
    """The pods' port: a number as given, a name looked up in the slice's ports."""
    if port.isdigit():
        return int(port)
    for p in endpoint_slice.get("ports") or []:
        if p.get("name") == port and p.get("port"):
            return int(p["port"])
    return None


def slice_addresses(endpoint_slice: dict[str, Any], port: str) -> list[str]:
    """"ip:port" of every ready, not terminating endpoint of one EndpointSlice (API field names).
    An unset `ready` counts as ready, as the API documents for consumers."""
    number = _slice_port(endpoint_slice, port)
    if number is None:
        return []
    out = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for ip in endpoint.get("addresses") or []:
            out.append(f"[{ip}]:{number}" if ":" in ip else f"{ip}:{number}")
    return out


def pool_addresses(slices: dict[str, dict[str, Any]], port: str) -> list[str]:
    """The union over a Service's slices (by slice name), sorted, each address once."""
    return sorted({a for s in slices.values() for a in slice_addresses(s, port)})


class KubernetesDiscovery:
    """Keeps ``pool`` equal to the Service's ready endpoints: a list, then a watch from its
    resourceVersion; any error or an expired watch starts over with a new list."""

    def __init__(self, pool: Pool, target: str, retry_s: float = 2.0, watch_timeout_s: int = 300):
        self.pool = pool
        self.namespace, self.service, self.port = parse_k8s_target(target)
        self.retry_s = retry_s
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="kvship-router-discovery-k8s", daemon=True)

    def _resource(self) -> Any:
        from kubernetes import client, config
        from kubernetes.dynamic import DynamicClient
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()  # $KUBECONFIG or ~/.kube/config: outside a cluster
        dynamic = DynamicClient(client.ApiClient())
        for api_version in SLICE_API_VERSIONS:
            try:
                return dynamic.resources.get(api_version=api_version, kind="EndpointSlice")
            except ResourceNotFoundError:
                continue
        raise RuntimeError(f"the API server serves no EndpointSlice API ({', '.join(SLICE_API_VERSIONS)})")

    def _apply(self) -> None:
        added, removed = set_addresses(self.pool, pool_addresses(self.slices, self.port))
        if added or removed:
            logger.info("discovered %s/%s: +%s -%s", self.namespace, self.service, added, removed)

    def _list_and_watch(self, slices: Any) -> None:
        from kubernetes import watch

        selector = f"{SERVICE_NAME_LABEL}={self.service}"
        listed = slices.get(namespace=self.namespace, label_selector=selector).to_dict()
        self.slices = {s["metadata"]["name"]: s for s in listed.get("items") or []}
        self._apply()
        self._watch = watch.Watch()
        for event in slices.watch(namespace=self.namespace, label_selector=selector, watcher=self._watch,
                                  resource_version=listed["metadata"]["resourceVersion"],
                                  timeout=self.watch_timeout_s):
            if self._stop.is_set():
                return
            obj = event["raw_object"]
            if event["type"] == "DELETED":
                self.slices.pop(obj["metadata"]["name"], None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                self.slices[obj["metadata"]["name"]] = obj
            self._apply()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._list_and_watch(self._resource())
            except Exception as exc:  # the API server unreachable, forbidden, a watch expired (410)
                logger.warning("EndpointSlices of %s/%s: %s; retrying", self.namespace, self.service, exc)
                self._stop.wait(self.retry_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread.is_alive():
            self._thread.join(5)
