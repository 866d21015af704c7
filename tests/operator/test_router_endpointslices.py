"""`kvship router --discover-k8s` against the real API server (issue 51): the router process,
authenticated as the ServiceAccount the operator makes for it (bound to the operator's Role,
nothing else), follows the serving Service's EndpointSlices as they are created, changed and
deleted. The slices are written by the test (no kubelet runs); the addresses need not answer:
the picker lists every endpoint it was given in /metrics, healthy or not."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import urllib.request

import pytest
from kubernetes.client import CoreV1Api

import k8s_cluster
from kvship_operator import builders as b
from kvship_operator import router_builders as rb
from kvship_operator import spec as s
from kvship_operator.kube import load_configuration, request
from kvship_operator.schema import parse
from operator_fixtures import api, cluster, crd_installed, namespace  # noqa: F401 - fixtures by name
from operator_helpers import wait_for

pytestmark = pytest.mark.timeout(180)


def _slice_api(api) -> str:
    for version in ("v1", "v1beta1"):
        try:
            request(api, "GET", f"/apis/discovery.k8s.io/{version}")
            return f"/apis/discovery.k8s.io/{version}"
        except Exception:  # noqa: BLE001 - not served by this server version
            continue
    raise AssertionError("no EndpointSlice API")


def _slice(name: str, service: str, ready: dict[str, bool]) -> dict:
    return {"apiVersion": "", "kind": "EndpointSlice",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": r}} for ip, r in ready.items()]}


def _endpoints(metrics_port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return {line.split('endpoint="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("kvship_router:endpoint_healthy{")}


def test_router_follows_endpointslices_as_its_service_account(cluster, api, namespace, tmp_path):  # noqa: F811
    owner = b.Owner("r", namespace, "u")
    spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "routing": {"mode": "envoy"}})
    for obj in (rb.router_service_account(owner, spec), rb.router_role(owner, spec),
                rb.router_role_binding(owner, spec)):
        obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}}
        plural = {"ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}[obj["kind"]]
        base = "/api/v1" if obj["apiVersion"] == "v1" else f"/apis/{obj['apiVersion']}"
        request(api, "POST", f"{base}/namespaces/{namespace}/{plural}", body=obj)
    token = wait_for(lambda: CoreV1Api(api).create_namespaced_service_account_token(
        rb.router_name(owner), namespace, {"spec": {"expirationSeconds": 3600}}).status.token, 20, what="SA token")
    admin = load_configuration(str(cluster.kubeconfig))
    kubeconfig = tmp_path / "router.kubeconfig"
    kubeconfig.write_text(k8s_cluster.kubeconfig_text(admin.host, admin.ssl_ca_cert, token=token, user="router",
                                                      namespace=namespace))

    slices = f"{_slice_api(api)}/namespaces/{namespace}/endpointslices"
    serving = rb.serving_name(owner)
    version = "/".join(slices.split("/")[2:4])  # discovery.k8s.io/v1 (or v1beta1 before 1.21)
    a = {**_slice("a", serving, {"10.77.0.1": True, "10.77.0.2": False}), "apiVersion": version}
    request(api, "POST", slices, body=a)
    other = {**_slice("other", "another-service", {"10.77.9.9": True}), "apiVersion": version}
    request(api, "POST", slices, body=other)  # another Service's slice: never in the pool

    args = rb.router_args(owner, spec)
    assert args[1:3] == ["--discover-k8s", f"{namespace}/{serving}:http"]
    picker_port, metrics_port = k8s_cluster.free_port(), k8s_cluster.free_port()
    log = tempfile.NamedTemporaryFile(prefix="kvship-router-k8s-", suffix=".log")
    router = subprocess.Popen(
        [sys.executable, "-m", "kvship.cli", "router", "--picker-only", "--discover-k8s", args[2],
         "--picker-host", "127.0.0.1", "--picker-port", str(picker_port), "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT,
        # outside a pod: the router falls back to $KUBECONFIG, the ServiceAccount's token
        env={**{k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}, "KUBECONFIG": str(kubeconfig)})
    try:
        def pool_is(want: set[str]):
            def check():
                assert router.poll() is None, open(log.name).read()[-2000:]
                try:
                    return _endpoints(metrics_port) == want
                except OSError:
                    return False
            wait_for(check, 60, what=f"pool {sorted(want)}",
                     show=lambda: (_endpoints(metrics_port), open(log.name).read()[-1500:]))

        pool_is({"10.77.0.1:8000"})  # the ready one only
        b_slice = {**_slice("b", serving, {"10.77.0.3": True}), "apiVersion": version}
        request(api, "POST", slices, body=b_slice)
        pool_is({"10.77.0.1:8000", "10.77.0.3:8000"})
        a["endpoints"][1]["conditions"]["ready"] = True  # the second replica became ready
        request(api, "PUT", f"{slices}/a", body={**request(api, "GET", f"{slices}/a"), "endpoints": a["endpoints"]})
        pool_is({"10.77.0.1:8000", "10.77.0.2:8000", "10.77.0.3:8000"})
        request(api, "DELETE", f"{slices}/b")
        pool_is({"10.77.0.1:8000", "10.77.0.2:8000"})
    finally:
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(10)
        log.close()
