"""The operator against a real kube-apiserver + kube-controller-manager on loopback.

No scheduler or kubelet runs: the StatefulSet controller creates pods, and the tests play the
kubelet by writing pod status."""
from __future__ import annotations

import json
import time

import pytest
from kubernetes.client.exceptions import ApiException

from kvship_operator import spec as s
from kvship_operator import status as status_mod
from kvship_operator.schema import parse
from operator_fixtures import (  # noqa: F401 - pytest finds fixtures by name in the module
    api,
    cluster,
    crd_installed,
    namespace,
    objects,
    run_operator,
)
from operator_helpers import REPO, load_yaml_docs, wait_for

HUB_SPEC = {
    "model": {"hub": "Qwen/Qwen3-0.6B"},
    "tensorParallelSize": 2,
    "replicas": 2,
    "modelCache": {"size": "20Gi"},
}


def cond(llmd: dict | None, type_: str) -> dict:
    for c in ((llmd or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def children(objects, name: str) -> dict:
    return {
        "sts": objects.get("apps/v1", "statefulsets", name),
        "svc": objects.get("v1", "services", name),
        "headless": objects.get("v1", "services", f"{name}-engines"),
        "pdb": objects.get("policy/v1beta1", "poddisruptionbudgets", name)
        or objects.get("policy/v1", "poddisruptionbudgets", name),
        # the first replica's cache claim (volumeClaimTemplates), made by the StatefulSet controller
        "pvc": objects.get("v1", "persistentvolumeclaims", f"model-cache-{name}-0"),
    }


def running_ready(pod_name: str) -> dict:
    """What a kubelet would report for a pod whose engine is up."""
    t = "2025-01-01T00:00:00Z"
    return {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
            {"type": "Initialized", "status": "True", "lastTransitionTime": t},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": t},
            {"type": "Ready", "status": "True", "lastTransitionTime": t},
        ],
        "initContainerStatuses": [{
            "name": "fetch-model", "ready": True, "restartCount": 0, "image": "kvship/engine:0.1.0", "imageID": "",
            "state": {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t, "finishedAt": t}},
        }],
        "containerStatuses": [{
            "name": "engine", "ready": True, "started": True, "restartCount": 0, "image": "kvship/engine:0.1.0",
            "imageID": "", "state": {"running": {"startedAt": t}},
        }],
    }


def test_apply_creates_children_and_status(objects, run_operator):
    run_operator()
    objects.create_llmd("qwen", HUB_SPEC)
    kids = wait_for(lambda: (k := children(objects, "qwen")) and all(k.values())
                    and k["pvc"]["metadata"].get("ownerReferences") and k, 30, what="children",
                    show=lambda: children(objects, "qwen"))
    cr = objects.llmd("qwen")
    for kind, obj in kids.items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LLMDeployment", "qwen", cr["metadata"]["uid"], True), kind
        managers = {(m["manager"], m["operation"]) for m in obj["metadata"]["managedFields"]}
        # (the per-replica claim is the StatefulSet controller's; the operator only adopts it)
        assert ("kvship-operator", "Update" if kind == "pvc" else "Apply") in managers, (kind, managers)
    # no finalizer on the CR: deletion never waits on the operator
    assert not cr["metadata"].get("finalizers")
    # defaults were applied by the API server from the CRD schema
    assert cr["spec"]["engine"]["image"] == "kvship/engine:0.1.0" and cr["spec"]["service"]["port"] == 8000

    sts = kids["sts"]
    assert sts["spec"]["replicas"] == 2
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    assert sts["spec"]["template"]["spec"]["initContainers"][0]["name"] == "fetch-model"
    assert kids["svc"]["spec"]["type"] == "ClusterIP" and kids["svc"]["spec"]["ports"][0]["port"] == 8000
    assert kids["headless"]["spec"]["clusterIP"] == "None"
    assert kids["pvc"]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert kids["pvc"]["spec"]["accessModes"] == ["ReadWriteOnce"]  # one per replica: any node can mount its own
    # the second replica's claim is adopted on its own pass (the watch event of its creation)
    second = wait_for(lambda: (p := objects.get("v1", "persistentvolumeclaims", "model-cache-qwen-1"))
                      and p["metadata"].get("ownerReferences") and p, 30, what="second claim adopted")
    assert second["metadata"]["ownerReferences"][0]["name"] == "qwen"

    def status_written():
        cr = objects.llmd("qwen")
        st = cr.get("status") or {}
        types = {c["type"] for c in st.get("conditions", [])}
        return st.get("observedGeneration") == cr["metadata"]["generation"] and types == set(status_mod.TYPES) and cr

    cr = wait_for(status_written, 20, what="status with observedGeneration")
    st = cr["status"]
    assert st["endpoint"] == f"http://qwen.{objects.ns}.svc.cluster.local:8000/v1"
    assert st["servedModelName"] == "Qwen/Qwen3-0.6B"
    assert st["selector"] == "app.kubernetes.io/name=kvship-engine,kvship.io/llmdeployment=qwen"
    for c in st["conditions"]:
        assert set(c) >= {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    assert cond(cr, "Ready")["status"] == "False"
    wait_for(lambda: any(e["reason"] == "Applied" and "created StatefulSet qwen" in e["message"]
                         for e in objects.events("qwen")), 30, what="an Applied event",
             show=lambda: objects.events("qwen"))

    # the scale subresource works (what HPA/KEDA use)
    scale = objects._call("GET", f"/apis/kvship.io/v1alpha1/namespaces/{objects.ns}/llmdeployments/qwen/scale")
    assert scale["spec"]["replicas"] == 2 and scale["status"]["selector"] == st["selector"]


def test_status_follows_pods(objects, run_operator):
    run_operator()
    objects.create_llmd("qwen", HUB_SPEC)
    pods = wait_for(lambda: len(p := objects.list("v1", "pods", "kvship.io/llmdeployment=qwen")) == 2 and p, 30,
                    what="pods created by the StatefulSet controller")
    names = sorted(p["metadata"]["name"] for p in pods)
    assert names == ["qwen-0", "qwen-1"]

    # not enough GPUs anywhere
    objects.patch_pod_status("qwen-0", {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": "2025-01-01T00:00:00Z",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]})
    cr = wait_for(lambda: cond(c := objects.llmd("qwen"), "Ready").get("reason") == "InsufficientGPU" and c, 20,
                  what="Ready=False InsufficientGPU")
    assert "Insufficient nvidia.com/gpu" in cond(cr, "Ready")["message"]

    # the download fails in the other pod
    objects.patch_pod_status("qwen-1", {"phase": "Pending", "initContainerStatuses": [{
        "name": "fetch-model", "ready": False, "restartCount": 1, "image": "kvship/engine:0.1.0", "imageID": "",
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                     "message": "download of Qwen/Qwen3-0.6B failed: 401 Unauthorized",
                                     "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:01Z"}}}]})
    cr = wait_for(lambda: cond(c := objects.llmd("qwen"), "ModelCached").get("reason") == "DownloadFailed" and c, 20,
                  what="ModelCached=False DownloadFailed")
    assert "401 Unauthorized" in cond(cr, "ModelCached")["message"]

    # both pods come up: the StatefulSet controller counts them ready, status follows
    for n in names:
        objects.patch_pod_status(n, running_ready(n))
    cr = wait_for(lambda: cond(c := objects.llmd("qwen"), "Ready").get("status") == "True"
                  and c["status"].get("readyReplicas") == 2 and c, 30, what="Ready=True with 2 ready replicas")
    assert cond(cr, "WorkloadReady")["reason"] == "AllReplicasReady"
    assert cond(cr, "ModelCached")["status"] == "True"
    assert cr["status"]["replicas"] == 2


def test_spec_update_rolls_statefulset(objects, run_operator):
    run_operator()
    objects.create_llmd("qwen", HUB_SPEC)
    sts = wait_for(lambda: objects.get("apps/v1", "statefulsets", "qwen"), 30, what="StatefulSet")
    gen0 = sts["metadata"]["generation"]
    objects.patch_llmd_spec("qwen", {"replicas": 3, "engine": {"args": ["--max-num-seqs", "64"]},
                                     "nodeSelector": {"pool": "h200"}})

    def updated():
        sts = objects.get("apps/v1", "statefulsets", "qwen")
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        return sts["spec"]["replicas"] == 3 and args[-2:] == ["--max-num-seqs", "64"] and sts

    sts = wait_for(updated, 30, what="StatefulSet updated")
    assert sts["metadata"]["generation"] > gen0  # a new pod template: pods roll
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "h200"}
    wait_for(lambda: (objects.llmd("qwen").get("status") or {}).get("observedGeneration") == 2, 20,
             what="observedGeneration 2")
    wait_for(lambda: any(e["reason"] == "Applied" and "updated StatefulSet qwen" in e["message"]
                         for e in objects.events("qwen")), 30, what="an Applied (updated) event")


@pytest.mark.parametrize(
    "spec, expect",
    [
        ({"model": {"hub": "Qwen/Qwen3-0.6B"}, "tensorParallelSize": 0},
         "spec.tensorParallelSize: Invalid value: 0: spec.tensorParallelSize in body should be greater than or equal to 1"),
        ({"model": {"hub": "Qwen/Qwen3-0.6B"}, "service": {"type": "Ingress"}},
         'spec.service.type: Unsupported value: "Ingress"'),
        ({"model": {"hub": "Qwen/Qwen3-0.6B"}, "modelCache": {"size": "lots"}}, "spec.modelCache.size"),
        ({"model": {"hub": "not a hub id"}}, "spec.model.hub in body should match"),
        ({"replicas": 1}, "spec.model: Required value"),
        ({"model": {"hub": "a/b", "url": "https://x/y"}}, "spec.model"),
    ],
)
def test_invalid_specs_refused_by_api_server(objects, spec, expect):
    with pytest.raises(ApiException) as e:
        objects.create_llmd("bad", spec)
    assert e.value.status == 422
    message = json.loads(e.value.body)["message"]
    assert expect in message, message


def test_cross_field_rule_reported_when_server_lacks_cel(objects, run_operator):
    """tensorParallelSize 3 is within the OpenAPI bounds; only the CEL rule refuses it.
    A server with CEL (>= 1.25) refuses it at once; an older one stores it and the operator
    refuses to act, saying why in status and in an event."""
    run_operator()
    try:
        objects.create_llmd("tp3", {"model": {"hub": "a/b"}, "tensorParallelSize": 3})
    except ApiException as e:
        assert e.status == 422 and "tensorParallelSize must be 1, 2, 4 or 8" in e.body
        return
    cr = wait_for(lambda: cond(c := objects.llmd("tp3"), "Ready").get("reason") == "InvalidSpec" and c, 20,
                  what="Ready=False InvalidSpec")
    assert "tensorParallelSize must be 1, 2, 4 or 8" in cond(cr, "Ready")["message"]
    assert objects.get("apps/v1", "statefulsets", "tp3") is None
    wait_for(lambda: any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in objects.events("tp3")),
             30, what="an InvalidSpec Warning event")
    # fixing the spec lets the operator proceed
    objects.patch_llmd_spec("tp3", {"tensorParallelSize": 4})
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "tp3"), 30, what="StatefulSet after the fix")


def test_delete_garbage_collects_children(objects, run_operator):
    run_operator()
    objects.create_llmd("qwen", HUB_SPEC)
    wait_for(lambda: all(children(objects, "qwen").values()), 30, what="children")
    wait_for(lambda: len(objects.list("v1", "pods", "kvship.io/llmdeployment=qwen")) == 2, 30, what="pods")
    objects.delete_llmd("qwen")
    # no finalizer: the CR is gone at once
    wait_for(lambda: objects.llmd("qwen") is None, 10, what="CR deleted")

    def all_gone():
        k = children(objects, "qwen")
        pvc = k.pop("pvc")
        pods = objects.list("v1", "pods", "kvship.io/llmdeployment=qwen")
        # the claim may linger only while marked for deletion (pvc-protection finalizer)
        return not any(k.values()) and not pods and (pvc is None or pvc["metadata"].get("deletionTimestamp"))

    wait_for(all_gone, 60, interval=0.5, what="children garbage-collected",
             show=lambda: (children(objects, "qwen"), objects.get("v1", "persistentvolumeclaims", "model-cache-qwen-1"),
                           [p["metadata"]["name"] for p in objects.list("v1", "pods", "kvship.io/llmdeployment=qwen")]))


def our_writes(obj: dict) -> list:
    return [m for m in obj["metadata"]["managedFields"] if m["manager"] == "kvship-operator"]


def test_operator_restart_resumes_without_duplicate_work(objects, run_operator):
    op = run_operator()
    objects.create_llmd("steady", {"model": {"hub": "a/b"}})
    objects.create_llmd("changing", {"model": {"hub": "a/b"}})
    try:  # accepted by servers without CEL; the operator reports it
        objects.create_llmd("invalid", {"model": {"hub": "a/b"}, "tensorParallelSize": 3})
        invalid = True
    except ApiException:
        invalid = False
    for n in ("steady", "changing"):
        wait_for(lambda n=n: (objects.llmd(n).get("status") or {}).get("observedGeneration") == 1, 30,
                 what=f"{n} reconciled")
    if invalid:
        wait_for(lambda: cond(objects.llmd("invalid"), "Ready").get("reason") == "InvalidSpec", 30, what="InvalidSpec")
    # kopf posts events from a queue, after the status they report: count them once posted
    wait_for(lambda: any(e["reason"] == "Applied" for e in objects.events("steady")), 30, what="steady's Applied event")
    if invalid:
        wait_for(lambda: any(e["reason"] == "InvalidSpec" for e in objects.events("invalid")), 30,
                 what="invalid's InvalidSpec event")
    steady_sts = objects.get("apps/v1", "statefulsets", "steady")
    steady_events = len([e for e in objects.events("steady") if e["reason"] == "Applied"])
    invalid_before = invalid and objects.llmd("invalid")
    invalid_rv = invalid and invalid_before["metadata"]["resourceVersion"]
    invalid_events = len(objects.events("invalid"))
    op.stop()

    # while the operator is down, one spec changes
    objects.patch_llmd_spec("changing", {"replicas": 2})
    run_operator()
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "changing")["spec"]["replicas"] == 2, 30,
             what="change made while the operator was down applied after restart")
    wait_for(lambda: (objects.llmd("changing").get("status") or {}).get("observedGeneration") == 2, 20,
             what="observedGeneration 2")
    # the untouched ones: resumed (give their resume handlers time to run), nothing re-created,
    # re-applied, re-written or announced again
    time.sleep(2)
    after = objects.get("apps/v1", "statefulsets", "steady")
    assert after["metadata"]["uid"] == steady_sts["metadata"]["uid"]
    assert after["metadata"]["generation"] == steady_sts["metadata"]["generation"]
    assert our_writes(after) == our_writes(steady_sts)  # (the controller-manager writes its status)
    assert len([e for e in objects.events("steady") if e["reason"] == "Applied"]) == steady_events
    if invalid:
        now = objects.llmd("invalid")
        assert now["metadata"]["resourceVersion"] == invalid_rv, (invalid_before, now)
        assert len(objects.events("invalid")) == invalid_events


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_apply_as_is(objects, path):
    """Every example is accepted by the API server as written, and by the operator's checks."""
    docs = load_yaml_docs(path)
    assert any(d["kind"] == "LLMDeployment" for d in docs)
    for d in docs:
        if d["kind"] == "LLMDeployment":
            parse(s.LLMDeploymentSpec, d["spec"])
            objects.create_llmd(d["metadata"]["name"], d["spec"])
        else:
            plural = {"Secret": "secrets", "PersistentVolumeClaim": "persistentvolumeclaims"}[d["kind"]]
            objects._call("POST", f"/api/v1/namespaces/{objects.ns}/{plural}", d)


def test_kvship_operator_command(cluster, objects, tmp_path):
    """The installed `kvship-operator` entry point, as a process: reconciles, serves its
    liveness endpoint, and stops cleanly on SIGTERM."""
    import shutil
    import signal
    import subprocess
    import sys
    import urllib.request

    import k8s_cluster

    exe = shutil.which("kvship-operator") or [sys.executable, "-m", "kvship_operator.main"]
    port = k8s_cluster.free_port()
    log = open(tmp_path / "operator.log", "wb")
    proc = subprocess.Popen(
        [*([exe] if isinstance(exe, str) else exe), "--kubeconfig", str(cluster.kubeconfig), "-n", objects.ns,
         "--liveness", f"http://127.0.0.1:{port}/healthz"], stdout=log, stderr=subprocess.STDOUT)
    try:
        objects.create_llmd("cli", {"model": {"hub": "a/b"}, "gpu": {"count": 0}})
        wait_for(lambda: objects.get("apps/v1", "statefulsets", "cli"), 30, what="StatefulSet from the CLI operator")
        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, 10, what="liveness endpoint")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    assert rc == 0, (tmp_path / "operator.log").read_text()[-3000:]


def test_deleted_statefulset_is_recreated(objects, run_operator):
    run_operator()
    objects.create_llmd("drift", {"model": {"hub": "a/b"}, "gpu": {"count": 0}})
    old = wait_for(lambda: objects.get("apps/v1", "statefulsets", "drift"), 30, what="StatefulSet")
    objects._call("DELETE", f"/apis/apps/v1/namespaces/{objects.ns}/statefulsets/drift")
    new = wait_for(lambda: (x := objects.get("apps/v1", "statefulsets", "drift"))
                   and x["metadata"]["uid"] != old["metadata"]["uid"] and x, 30, what="StatefulSet re-created")
    assert new["metadata"]["ownerReferences"][0]["name"] == "drift"


def test_scale_subresource_drives_replicas(objects, run_operator):
    """What an HPA or KEDA does: write /scale; the StatefulSet follows."""
    run_operator()
    objects.create_llmd("scaled", {"model": {"hub": "a/b"}, "gpu": {"count": 0}})
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "scaled"), 30, what="StatefulSet")
    path = f"/apis/kvship.io/v1alpha1/namespaces/{objects.ns}/llmdeployments/scaled/scale"
    objects._call("PATCH", path, {"spec": {"replicas": 3}}, "application/merge-patch+json")
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "scaled")["spec"]["replicas"] == 3, 30,
             what="StatefulSet scaled to 3")
    wait_for(lambda: objects._call("GET", path)["status"]["replicas"] == 3, 30, what="scale status replicas 3")


def test_apply_failure_reported(objects, run_operator):
    """A child the API server refuses: Ready=False ApplyFailed with the server's words, and
    a Warning event; fixing the spec recovers."""
    run_operator()
    objects.create_llmd("refused", {"model": {"hub": "a/b"}, "gpu": {"count": 0},
                                    "engine": {"env": [{"name": "X", "valueFrom": {"noSuchSource": {}}}]}})
    def state():
        return objects.llmd("refused"), objects.events("refused")

    cr = wait_for(lambda: cond(c := objects.llmd("refused"), "Ready").get("reason") == "ApplyFailed" and c, 30,
                  what="Ready=False ApplyFailed", show=state)
    message = cond(cr, "Ready")["message"]
    assert "applying StatefulSet refused failed" in message and "noSuchSource" in message, message
    # kopf posts events on its own schedule: the event may trail the status patch
    wait_for(lambda: any(e["reason"] == "ApplyFailed" and e["type"] == "Warning" for e in objects.events("refused")),
             30, what="an ApplyFailed Warning event", show=state)
    objects.patch_llmd_spec("refused", {"engine": {"env": [{"name": "X", "value": "1"}]}})
    wait_for(lambda: objects.get("apps/v1", "statefulsets", "refused"), 30, what="StatefulSet after the fix", show=state)
    wait_for(lambda: cond(objects.llmd("refused"), "Ready").get("reason") != "ApplyFailed", 30, what="ApplyFailed cleared",
             show=state)
