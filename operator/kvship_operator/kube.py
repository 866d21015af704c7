"""Kubernetes API access for the operator: one explicitly configured client (never the
library's global default, so tests can run an operator with other credentials in the same
process), server-side apply with our field manager, status patches, discovery."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import kubernetes
from kubernetes.client import ApiClient, Configuration
from kubernetes.client.exceptions import ApiException

from . import spec as s
from .builders import FIELD_MANAGER

# plural names of the kinds the operator applies
PLURALS = {
    "StatefulSet": "statefulsets",
    "Deployment": "deployments",
    "InferencePool": "inferencepools",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ConfigMap": "configmaps",
    "ScaledObject": "scaledobjects",
    "Pod": "pods",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}


def load_configuration(kubeconfig: str | None = None) -> Configuration:
    """In-cluster service account when running in a pod, else the given kubeconfig, else
    $KUBECONFIG, else ~/.kube/config."""
    cfg = Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=cfg)
        return cfg
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    kubernetes.config.load_kube_config(config_file=path, client_configuration=cfg)
    return cfg


def bearer_token(cfg: Configuration) -> str | None:
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    if not header:
        return None
    return header.split(" ", 1)[-1]


def object_path(obj: dict[str, Any], *, name: str | None = None, subresource: str | None = None) -> str:
    api_version = obj["apiVersion"]
    plural = PLURALS[obj["kind"]]
    ns = obj["metadata"]["namespace"]
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{ns}/{plural}/{name or obj['metadata']['name']}"
    return f"{path}/{subresource}" if subresource else path


REQUEST_TIMEOUT = (5, 30)  # seconds: connect, read


def request(api: ApiClient, method: str, path: str, *, body: Any = None, query: list | None = None,
            content_type: str = "application/json") -> Any:
    """One API call through the client's serialisation, auth and TLS; returns the decoded
    JSON, raises ApiException (with the server's Status body) on an error status."""
    m, url, headers, data, _ = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params={"Content-Type": content_type, "Accept": "application/json"},
        body=body,
        auth_settings=["BearerToken"],
    )
    # A bounded wait: a call stuck on a dead connection must not hold a handler (or shutdown) forever.
    resp = api.call_api(m, url, header_params=headers, body=data, _request_timeout=REQUEST_TIMEOUT)
    raw = resp.read()
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else (raw or "")
    if not 200 <= resp.status < 300:
        raise ApiException.from_response(http_resp=resp, body=text, data=None)
    return json.loads(text) if text else None


@dataclass
class Kube:
    api: ApiClient
    # where a pod's engine answers (metrics_client.pod_ip_address in a cluster; tests point
    # pods at servers on loopback): status asks each ready pod what it serves
    pod_address: Optional[Callable[[dict[str, Any]], Optional[str]]] = None

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> "Kube":
        return cls(ApiClient(load_configuration(kubeconfig)))

    def _call(self, method: str, path: str, *, body: Any = None, query: list | None = None,
              content_type: str = "application/json") -> Any:
        return request(self.api, method, path, body=body, query=query, content_type=content_type)

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply (creates or updates) with our field manager; conflicts with
        other managers are forced: the operator owns what it builds."""
        return self._call(
            "PATCH",
            object_path(obj),
            body=obj,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        stub = {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": namespace, "name": name}}
        try:
            return self._call("GET", object_path(stub))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        out = self._call("GET", f"/api/v1/namespaces/{namespace}/pods", query=[("labelSelector", selector)])
        return list(out.get("items") or [])

    def get_llmd(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"/apis/{s.GROUP}/{s.VERSION}/namespaces/{namespace}/{s.PLURAL}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def patch_llmd_status(self, namespace: str, name: str, status: dict[str, Any],
                          resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch the status; with ``resource_version`` only if nobody wrote since
        (409 Conflict otherwise), so concurrent writers never go back in time."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._call(
            "PATCH",
            f"/apis/{s.GROUP}/{s.VERSION}/namespaces/{namespace}/{s.PLURAL}/{name}/status",
            body=body,
            content_type="application/merge-patch+json",
        )

    def _succeeds(self, method: str, path: str) -> bool:
        """True when the call succeeds, False when the server answers 404."""
        try:
            self._call(method, path)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def has_api(self, group_version: str) -> bool:
        return self._succeeds("GET", f"/apis/{group_version}")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete one object; False when it was not there."""
        stub = {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": namespace, "name": name}}
        return self._succeeds("DELETE", object_path(stub))

    def patch_llmd_replicas(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set spec.replicas through the scale subresource (as an HPA would)."""
        return self._call(
            "PATCH",
            f"/apis/{s.GROUP}/{s.VERSION}/namespaces/{namespace}/{s.PLURAL}/{name}/scale",
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def delete_orphaning(self, api_version: str, kind: str, namespace: str, name: str, wait: float = 30) -> None:
        """Delete an object leaving its dependents in place, and wait until it is gone."""
        import time

        stub = {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": namespace, "name": name}}
        try:
            self._call("DELETE", object_path(stub), body={"propagationPolicy": "Orphan"})
        except ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + wait
        while self.get(api_version, kind, namespace, name) is not None:
            if time.monotonic() > deadline:
                raise ApiException(status=409, reason=f"{kind} {name} still being deleted")
            time.sleep(0.2)

    def set_owner(self, api_version: str, kind: str, namespace: str, name: str, reference: dict[str, Any]) -> None:
        stub = {"apiVersion": api_version, "kind": kind, "metadata": {"namespace": namespace, "name": name}}
        self._call("PATCH", object_path(stub), body={"metadata": {"ownerReferences": [reference]}},
                   query=[("fieldManager", FIELD_MANAGER)], content_type="application/merge-patch+json")

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete one pod, only if it is still that pod (uid); False when it was not there."""
        try:
            self._call("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                       body={"preconditions": {"uid": uid}})
            return True
        except ApiException as e:
            if e.status in (404, 409):
                return False
            raise

    def get_storage_class(self, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"/apis/storage.k8s.io/v1/storageclasses/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def has_crd(self, name: str) -> bool:
        return self._succeeds("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")

    def hpa_api_version(self) -> str:
        return "autoscaling/v2" if self.has_api("autoscaling/v2") else "autoscaling/v2beta2"

    def pdb_api_version(self) -> str:
        return "policy/v1" if self.has_api("policy/v1") else "policy/v1beta1"
