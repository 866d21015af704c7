"""Issue 58, items 1 and 2, against the real API server and controller manager, with stand-in
pods: a test kubelet binds each pod, marks it ready a moment later (its model load), and
for a pod being deleted waits a moment (its drain) before confirming the deletion.

1. Progressing says Complete only when the StatefulSet is at the spec's replicas, every pod
   runs the current revision and is ready, and nothing terminates: through a one-replica
   update, every time status says Complete the StatefulSet and pods read right after are in
   that state, and it never goes back to True.
2. A pod template edited by hand is put back without a rollout: no pod is created or
   replaced, and the StatefulSet's replicas are never raised for a surge pod."""
from __future__ import annotations

import threading
import time

import pytest
from kubernetes import watch
from kubernetes.client import CoreV1Api

from kvship_operator import spec as s
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from test_operator_cluster import cond, running_ready

NODE = "test-node"
LOAD_S = 1.0  # a pod's "model load": created -> ready
DRAIN_S = 1.0  # a deleted pod's preStop wait and drain
SPEC = {"model": {"pvc": {"claimName": "models"}}, "gpu": {"count": 0}, "modelCache": {"enabled": False},
        "replicas": 1, "engine": {"args": ["--max-num-seqs", "4"]},
        "resources": {"requests": {"cpu": "100m", "memory": "100Mi"}}, "shutdownTimeoutSeconds": 10}


class StandInKubelet(threading.Thread):
    """Runs the pods of one LLMDeployment the way a kubelet would, minus the containers."""

    def __init__(self, objects, name: str):
        super().__init__(daemon=True, name=f"kubelet-{name}")
        self.o, self.selector = objects, f"kvship.io/llmdeployment={name}"
        self.stop_flag = threading.Event()
        self.seen: dict[str, float] = {}  # uid -> when first seen
        self.ready: set[str] = set()
        self.leaving: dict[str, float] = {}  # uid -> when first seen terminating
        self.error: str | None = None

    def run(self) -> None:
        while not self.stop_flag.wait(0.1):
            try:
                self._tick()
            except Exception as e:  # noqa: BLE001 - a pod went away between calls; reported if it persists
                self.error = repr(e)

    def _tick(self) -> None:
        now = time.monotonic()
        for pod in self.o.list("v1", "pods", self.selector):
            meta = pod["metadata"]
            uid, name = meta["uid"], meta["name"]
            if uid not in self.seen:
                self.seen[uid] = now
                if not pod["spec"].get("nodeName"):
                    self.o._call("POST", f"/api/v1/namespaces/{self.o.ns}/pods/{name}/binding",
                                 {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                                  "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}})
            if meta.get("deletionTimestamp"):
                self.leaving.setdefault(uid, now)
                if now - self.leaving[uid] >= DRAIN_S:
                    self.o._call("DELETE", f"/api/v1/namespaces/{self.o.ns}/pods/{name}",
                                 {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
            elif uid not in self.ready and now - self.seen[uid] >= LOAD_S:
                self.o.patch_pod_status(name, running_ready(name))
                self.ready.add(uid)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(10)
        assert not self.is_alive(), "the stand-in kubelet did not stop"


def ensure_node(objects) -> None:
    if objects.get("v1", "nodes", NODE) is None:
        try:
            objects._call("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        except Exception:  # noqa: BLE001 - made meanwhile by another test
            pass


def settled(objects, name: str) -> str | None:
    """Why the StatefulSet and pods are not yet where a finished rollout leaves them (None:
    they are): at the spec's replicas, every pod on the update revision, ready, none
    terminating, and the controller's counts saying the same."""
    cr = objects.llmd(name)
    sts = objects.get("apps/v1", "statefulsets", name)
    pods = objects.list("v1", "pods", f"kvship.io/llmdeployment={name}")
    want = cr["spec"]["replicas"]
    st = sts.get("status") or {}
    if sts["spec"]["replicas"] != want:
        return f"StatefulSet replicas {sts['spec']['replicas']}"
    if len(pods) != want:
        return f"{len(pods)} pods: {[p['metadata']['name'] for p in pods]}"
    for p in pods:
        if p["metadata"].get("deletionTimestamp"):
            return f"{p['metadata']['name']} terminating"
        if p["metadata"]["labels"].get("controller-revision-hash") != st.get("updateRevision"):
            return f"{p['metadata']['name']} on an old revision"
        if cond(p, "Ready").get("status") != "True":
            return f"{p['metadata']['name']} not ready"
    if (st.get("replicas"), st.get("updatedReplicas"), st.get("readyReplicas")) != (want, want, want):
        return f"StatefulSet status {st}"
    return None


@pytest.mark.timeout(180)
def test_progressing_complete_means_the_rollout_is_over(objects, run_operator):
    """Item 1, the steps that showed it: a one-replica args change; status said Complete when
    the surge pod became ready (the old pod still terminating, the StatefulSet at 2), then
    Scaling, then Complete again while the surge pod drained."""
    ensure_node(objects)
    kubelet = StandInKubelet(objects, "prog")
    kubelet.start()
    try:
        run_operator()
        objects.create_llmd("prog", SPEC)
        wait_for(lambda: cond(objects.llmd("prog"), "Progressing").get("reason") == "Complete", 60,
                 what="first replica up", show=lambda: objects.llmd("prog").get("status"))
        assert settled(objects, "prog") is None
        first = {p["metadata"]["uid"] for p in objects.list("v1", "pods", "kvship.io/llmdeployment=prog")}

        generation = objects.patch_llmd_spec("prog", {"engine": {"args": ["--max-num-seqs", "2"]}})["metadata"][
            "generation"]
        samples = []  # (seconds since the change, Progressing, why not settled)
        t0 = time.monotonic()
        done_at = None
        while time.monotonic() - t0 < 90:
            c = cond(objects.llmd("prog"), "Progressing")
            if c.get("observedGeneration") == generation:
                samples.append((round(time.monotonic() - t0, 2), c["status"], c["reason"], settled(objects, "prog")))
                if c["reason"] == "Complete" and done_at is None:
                    done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > 3:
                break  # watched a while past Complete: it must not go back
            time.sleep(0.1)
        assert done_at is not None, samples[-20:]
        early = [x for x in samples if x[2] == "Complete" and x[3] is not None]
        assert not early, f"Complete while the rollout was not over: {early[:5]}"
        first_complete = next(i for i, x in enumerate(samples) if x[2] == "Complete")
        assert all(x[2] == "Complete" for x in samples[first_complete:]), samples[first_complete:]
        assert any(x[1] == "True" for x in samples), samples[:10]  # the rollout was seen in progress
        # the update really went through the surge pod and replaced the old one
        assert len(kubelet.seen) >= 3, kubelet.seen
        now = {p["metadata"]["uid"] for p in objects.list("v1", "pods", "kvship.io/llmdeployment=prog")}
        assert not now & first
    finally:
        kubelet.stop()


@pytest.mark.timeout(120)
def test_hand_edited_template_is_repaired_without_a_spare_pod(api, objects, run_operator):
    """Item 2, the steps that showed it: `kubectl patch sts` of the image; the operator put
    the image back but first took the edit for a new revision and asked for the surge
    replica: a pod was created, started and deleted within a second."""
    ensure_node(objects)
    kubelet = StandInKubelet(objects, "edit")
    kubelet.start()
    try:
        run_operator()
        objects.create_llmd("edit", SPEC)
        wait_for(lambda: cond(objects.llmd("edit"), "Progressing").get("reason") == "Complete", 60,
                 what="first replica up", show=lambda: objects.llmd("edit").get("status"))
        pod = objects.get("v1", "pods", "edit-0")
        sts = objects.get("apps/v1", "statefulsets", "edit")
        image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == s.DEFAULT_ENGINE_IMAGE

        # every pod created from here on, and every replicas value the StatefulSet takes
        added: list[str] = []
        rv = CoreV1Api(api).list_namespaced_pod(objects.ns).metadata.resource_version
        watcher = threading.Thread(target=lambda: added.extend(
            e["object"].metadata.name for e in watch.Watch().stream(
                CoreV1Api(api).list_namespaced_pod, objects.ns, resource_version=rv, timeout_seconds=8,
                _request_timeout=20) if e["type"] == "ADDED"), daemon=True)
        watcher.start()
        objects._call("PATCH", f"/apis/apps/v1/namespaces/{objects.ns}/statefulsets/edit",
                      {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "someone/else:1"}]}}}},
                      "application/strategic-merge-patch+json")
        wait_for(lambda: objects.get("apps/v1", "statefulsets", "edit")["spec"]["template"]["spec"]["containers"][0][
            "image"] == image, 20, what="the image put back")
        wait_for(lambda: settled(objects, "edit") is None and cond(objects.llmd("edit"), "Progressing").get(
            "reason") == "Complete", 20, what="settled", show=lambda: settled(objects, "edit"))
        watcher.join(30)
        assert not watcher.is_alive()
        assert added == [], f"pods created by repairing a hand edit: {added}"
        after = objects.get("apps/v1", "statefulsets", "edit")
        # two writes of the spec: the edit and its repair (a surge would add two more)
        assert after["metadata"]["generation"] == sts["metadata"]["generation"] + 2, after["metadata"]
        assert after["spec"]["replicas"] == 1
        assert objects.get("v1", "pods", "edit-0")["metadata"]["uid"] == pod["metadata"]["uid"]  # not replaced
        creates = [e["message"] for e in objects.events("edit") if e["reason"] == "SuccessfulCreate"]
        assert not any("edit-1" in m for m in creates), creates
    finally:
        kubelet.stop()
