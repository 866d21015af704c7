"""spec.routing and scale from zero (issue 51) against the real API server and operator.

Modes: envoy puts the router Deployment behind the Service; gateway runs the picker alone and
makes an InferencePool once that CRD exists (a stand-in CRD here: the test cluster has no Gateway
API Inference Extension); service removes the router's children. Scale from zero: the built-in
autoscaler brings the first replica up when the router reports held requests and removes the
last one after the idle window. No kubelet runs: pods are marked Ready by the test, and their
/metrics are real HTTP servers on loopback standing in for the router and the engine."""
from __future__ import annotations

import threading
import time

import pytest
from kubernetes.client import ApiextensionsV1Api
from kubernetes.client.exceptions import ApiException

from kvship_operator import builders as b
from kvship_operator import metrics_client
from kvship_operator import router_builders as rb
from operator_fixtures import (  # noqa: F401 - pytest finds fixtures by name in the module
    api,
    cluster,
    crd_installed,
    namespace,
    objects,
    run_operator,
)
from operator_helpers import wait_for
from test_operator_cluster import running_ready
from test_scale_zero import RouterPage

pytestmark = pytest.mark.timeout(300)
BASE = {"model": {"hub": "a/b"}, "gpu": {"count": 0}}


def stand_in_pool_crd() -> dict:
    """Just enough of an InferencePool CRD for the operator to find it and store a pool."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": rb.INFERENCE_POOL_CRD,
                     "annotations": {"api-approved.kubernetes.io": "unapproved, test stand-in"}},
        "spec": {"group": "inference.networking.k8s.io", "scope": "Namespaced",
                 "names": {"kind": "InferencePool", "plural": "inferencepools", "singular": "inferencepool",
                           "listKind": "InferencePoolList"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {"spec": {"type": "object",
                                                               "x-kubernetes-preserve-unknown-fields": True}}}}}]},
    }


class Kubelet(threading.Thread):
    """Marks every pod of one LLMDeployment (engines and router) Ready as soon as it exists."""

    def __init__(self, objects, name: str):
        super().__init__(daemon=True)
        self.objects, self.name, self.stop_flag = objects, name, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.3):
            try:
                for pod in self.objects.list("v1", "pods", f"{b.INSTANCE_LABEL}={self.name}"):
                    if not metrics_client.is_ready(pod) and not pod["metadata"].get("deletionTimestamp"):
                        self.objects.patch_pod_status(pod["metadata"]["name"], running_ready(pod["metadata"]["name"]))
            except Exception:  # noqa: BLE001 - pods come and go
                pass

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(10)


def test_routing_modes(api, objects, run_operator):
    run_operator()
    objects.create_llmd("r", {**BASE, "replicas": 1, "routing": {"mode": "envoy"}})
    dep = wait_for(lambda: objects.get("apps/v1", "deployments", "r-router"), 30, what="router Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["router", "--discover-k8s"]
    svc = wait_for(lambda: objects.get("v1", "services", "r"), 30, what="Service")
    assert svc["spec"]["selector"]["app.kubernetes.io/name"] == "kvship-router"
    # the router reads the serving Service's EndpointSlices with its own ServiceAccount and Role
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "r-router"
    for api_version, plural in [("v1", "serviceaccounts"), ("rbac.authorization.k8s.io/v1", "roles"),
                                ("rbac.authorization.k8s.io/v1", "rolebindings")]:
        wait_for(lambda: objects.get(api_version, plural, "r-router"), 30, what=f"{plural}/r-router")
    serving = objects.get("v1", "services", "r-serving")
    assert serving["spec"]["clusterIP"] == "None"
    assert objects.get("v1", "services", "r-router")["spec"]["ports"][0]["port"] == rb.PICKER_PORT
    cr = wait_for(lambda: (c := objects.llmd("r")).get("status", {}).get("router") and c, 30, what="status.router")
    assert cr["status"]["router"]["mode"] == "envoy"
    assert any(c["type"] == "RouterReady" and c["status"] == "False" for c in cr["status"]["conditions"])

    # the Deployment controller makes the router pod; once it is ready, status says so
    kubelet = Kubelet(objects, "r")
    kubelet.start()
    try:
        wait_for(lambda: any(c["type"] == "RouterReady" and c["status"] == "True"
                             for c in objects.llmd("r")["status"]["conditions"]), 60, what="RouterReady True",
                 show=lambda: objects.llmd("r")["status"])
    finally:
        kubelet.stop()

    # a router child deleted or scaled by hand is put back
    objects._call("DELETE", f"/api/v1/namespaces/{objects.ns}/services/r-serving")
    objects._call("PATCH", f"/apis/apps/v1/namespaces/{objects.ns}/deployments/r-router", {"spec": {"replicas": 3}},
                  "application/merge-patch+json")
    wait_for(lambda: objects.get("v1", "services", "r-serving"), 30, what="r-serving restored")
    wait_for(lambda: objects.get("apps/v1", "deployments", "r-router")["spec"]["replicas"] == 1, 30,
             what="router replicas restored")

    # gateway without the InferencePool CRD: the picker runs alone, and a warning says why no pool
    objects.patch_llmd_spec("r", {"routing": {"mode": "gateway"}})
    wait_for(lambda: "--picker-only" in objects.get("apps/v1", "deployments", "r-router")["spec"]["template"]["spec"][
        "containers"][0]["args"], 30, what="picker-only router")
    assert objects.get("v1", "services", "r")["spec"]["selector"]["app.kubernetes.io/name"] == "kvship-engine"
    wait_for(lambda: any(e["reason"] == "InferencePoolCRDMissing" for e in objects.events("r")), 30,
             what="InferencePoolCRDMissing warning")

    ext = ApiextensionsV1Api(api)
    ext.create_custom_resource_definition(stand_in_pool_crd())
    try:
        wait_for(lambda: any(c.type == "Established" and c.status == "True" for c in
                             ext.read_custom_resource_definition(rb.INFERENCE_POOL_CRD).status.conditions or []),
                 30, what="InferencePool CRD established")
        objects.patch_llmd_spec("r", {"routing": {"replicas": 2}})  # any change: the next reconcile sees the CRD
        pool = wait_for(lambda: objects.get(rb.INFERENCE_POOL_API_VERSION, "inferencepools", "r"), 30,
                        what="InferencePool")
        assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "r-router",
                                                     "port": {"number": rb.PICKER_PORT}, "failureMode": "FailClose"}
        assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvship-engine"

        # back to a plain Service: every router child goes
        objects.patch_llmd_spec("r", {"routing": {"mode": "service"}})
        for api_version, plural, name in [("apps/v1", "deployments", "r-router"), ("v1", "services", "r-router"),
                                          ("v1", "services", "r-serving"), ("v1", "serviceaccounts", "r-router"),
                                          ("rbac.authorization.k8s.io/v1", "roles", "r-router"),
                                          ("rbac.authorization.k8s.io/v1", "rolebindings", "r-router"),
                                          (rb.INFERENCE_POOL_API_VERSION, "inferencepools", "r")]:
            wait_for(lambda: objects.get(api_version, plural, name) is None, 30, what=f"{plural}/{name} deleted")
        cr = wait_for(lambda: (c := objects.llmd("r"))["status"].get("router") is None and c, 30,
                      what="status.router gone")
        assert not any(c["type"] == "RouterReady" for c in cr["status"]["conditions"])
    finally:
        try:
            ext.delete_custom_resource_definition(rb.INFERENCE_POOL_CRD)
        except ApiException:
            pass


IDLE, INTERVAL = 30, 1


def test_scale_from_zero_and_back(objects, run_operator):
    router = RouterPage(f"{b.ROUTER_PENDING_METRIC} 0\n")
    engine = RouterPage('kvship:num_requests_waiting{model_name="z"} 0\nkvship:num_requests_running{model_name="z"} 0\n')

    def pod_address(pod: dict) -> str | None:
        if pod["metadata"]["namespace"] != objects.ns:
            return None
        labels = pod["metadata"].get("labels") or {}
        return router.address if labels.get("app.kubernetes.io/name") == b.ROUTER_APP else engine.address

    kubelet = Kubelet(objects, "z")
    kubelet.start()
    run_operator(pod_address=pod_address)
    try:
        objects.create_llmd("z", {**BASE, "replicas": 0, "routing": {"mode": "envoy", "holdSeconds": 120},
                                  "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                                  "intervalSeconds": INTERVAL, "idleSeconds": IDLE}})
        args = wait_for(lambda: objects.get("apps/v1", "deployments", "z-router"), 30, what="router")[
            "spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--hold-timeout") + 1] == "120"

        def autoscaling() -> dict:
            return (objects.llmd("z").get("status") or {}).get("autoscaling") or {}

        wait_for(lambda: autoscaling().get("reason") == "Idle", 30, what="idle at zero", show=autoscaling)
        time.sleep(3 * INTERVAL)
        assert objects.llmd("z")["spec"]["replicas"] == 0  # no demand, no replica

        router.set(f"{b.ROUTER_PENDING_METRIC} 2\n")  # two requests held by the router
        wait_for(lambda: objects.llmd("z")["spec"]["replicas"] == 1, 30, what="0 -> 1", show=autoscaling)
        # the status's reason is rewritten at the next poll (one second): the event is what stays
        wait_for(lambda: "ScaledFromZero" in {e["reason"] for e in objects.events("z")}, 30, what="0 -> 1 event")
        wait_for(lambda: objects.get("apps/v1", "statefulsets", "z")["spec"]["replicas"] == 1, 30,
                 what="StatefulSet follows")
        router.set(f"{b.ROUTER_PENDING_METRIC} 0\n")  # released to the replica, which is idle after
        t_idle = time.monotonic()

        wait_for(lambda: objects.llmd("z")["spec"]["replicas"] == 0, IDLE + 30, what="back to 0", show=autoscaling)
        assert time.monotonic() - t_idle >= IDLE - 2 * INTERVAL
        wait_for(lambda: "ScaledToZero" in {e["reason"] for e in objects.events("z")}, 30, what="1 -> 0 event")
        assert autoscaling().get("lastScaleTime")
    finally:
        kubelet.stop()
        router.close()
        engine.close()
