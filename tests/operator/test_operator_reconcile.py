"""Reconciling against a real API server: an unchanged spec writes nothing (every example),
hand edits and deletions of children are repaired, and one refused child does not hold the
others back (issue #20, items 5, 6 and 8)."""
from __future__ import annotations

import json
import time

import pytest

from kvship_operator import builders as b
from kvship_operator import router_builders as rb
from kvship_operator import spec as s
from kvship_operator.apply import contains
from kvship_operator.schema import parse
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import REPO, load_yaml_docs, wait_for
from test_operator_cluster import cond

PLURALS = {"StatefulSet": "statefulsets", "Service": "services", "PersistentVolumeClaim": "persistentvolumeclaims",
           "PodDisruptionBudget": "poddisruptionbudgets", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
           "Deployment": "deployments", "ServiceAccount": "serviceaccounts", "Role": "roles",
           "RoleBinding": "rolebindings"}


def live_children(objects, cr: dict) -> dict[tuple[str, str], dict]:
    """Every child the spec builds, as the server has it."""
    owner = b.Owner(cr["metadata"]["name"], objects.ns, cr["metadata"]["uid"])
    pdb_version = "policy/v1" if _has(objects, "policy/v1") else "policy/v1beta1"
    out = {}
    for obj in rb.children(owner, parse(s.LLMDeploymentSpec, cr["spec"]), pdb_api_version=pdb_version):
        key = (obj["kind"], obj["metadata"]["name"])
        out[key] = (obj, objects.get(obj["apiVersion"], PLURALS[obj["kind"]], obj["metadata"]["name"]))
    return out


def _has(objects, group_version: str) -> bool:
    try:
        objects._call("GET", f"/apis/{group_version}")
        return True
    except Exception:  # noqa: BLE001
        return False


def writes(obj: dict) -> tuple:
    """What changes when the operator writes an object (controllers keep writing status, so
    the resourceVersion is no measure): its generation, and our managed-fields entries
    (their time moves with every write of ours)."""
    ours = [m for m in obj["metadata"].get("managedFields") or [] if m["manager"] == b.FIELD_MANAGER]
    return obj["metadata"].get("generation"), json.dumps(ours, sort_keys=True)


def reconciled(objects, name: str) -> dict | None:
    cr = objects.llmd(name)
    st = (cr or {}).get("status") or {}
    ok = st.get("observedGeneration") == cr["metadata"]["generation"] and cond(cr, "Synced").get("status") == "True"
    return cr if ok else None


def last_handled(cr: dict) -> dict:
    raw = (cr["metadata"].get("annotations") or {}).get("kvship.io/last-handled-configuration") or "{}"
    return json.loads(raw)


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_unchanged_spec_makes_zero_writes(objects, run_operator, path):
    """Item 8: a PVC-sourced deployment was rewritten on every reconcile (resourceVersion
    climbing, an "updated StatefulSet" event after an unrelated change). For every example:
    reconcile, then make a change that touches no child (a label on the resource: the update
    handler runs again) and check that no child was written and nothing announced."""
    docs = load_yaml_docs(path)
    run_operator()
    names = []
    for d in docs:
        if d["kind"] == "LLMDeployment":
            objects.create_llmd(d["metadata"]["name"], d["spec"])
            names.append(d["metadata"]["name"])
        else:
            plural = {"Secret": "secrets", "PersistentVolumeClaim": "persistentvolumeclaims"}[d["kind"]]
            objects._call("POST", f"/api/v1/namespaces/{objects.ns}/{plural}", d)
    for name in names:
        cr = wait_for(lambda: reconciled(objects, name), 30, what=f"{name} reconciled",
                      show=lambda: objects.llmd(name).get("status"))
        kids = live_children(objects, cr)
        for key, (wanted, live) in kids.items():
            assert live is not None, key
            # what the server keeps contains everything the operator asks for: nothing it
            # applies is dropped or rewritten by the server (which would make every apply a write)
            assert contains(live, wanted), (key, wanted, live)
        versions = {k: writes(live) for k, (_, live) in kids.items()}
        # kopf posts events on its own schedule: the creation's may trail the status
        applied = wait_for(lambda: [e["message"] for e in objects.events(name) if e["reason"] == "Applied"], 30,
                           what="the Applied event of the creation")

        objects._call("PATCH", f"/apis/{s.API_VERSION}/namespaces/{objects.ns}/{s.PLURAL}/{name}",
                      {"metadata": {"labels": {"touched": "yes"}}}, "application/merge-patch+json")
        wait_for(lambda: (last_handled(objects.llmd(name)).get("metadata", {}).get("labels") or {}).get("touched"),
                 30, what="the update handler ran for the label change")
        time.sleep(1.5)  # anything it would write is written by now
        after = {k: writes(live) for k, (_, live) in live_children(objects, objects.llmd(name)).items()}
        assert after == versions, f"{name}: children written by a reconcile that changed nothing"
        assert [e["message"] for e in objects.events(name) if e["reason"] == "Applied"] == applied


def test_hand_edits_and_deletions_are_repaired(objects, run_operator):
    """Item 6, the steps that showed it: Service and PDB deleted, StatefulSet scaled to 5,
    its image changed to another image; nothing restored after 20 s. Now each is restored."""
    run_operator()
    objects.create_llmd("drift", {"model": {"hub": "a/b"}, "gpu": {"count": 0}, "replicas": 1})
    cr = wait_for(lambda: reconciled(objects, "drift"), 30, what="reconciled")
    pdb_version = "policy/v1" if _has(objects, "policy/v1") else "policy/v1beta1"
    svc = objects.get("v1", "services", "drift")
    pdb = objects.get(pdb_version, "poddisruptionbudgets", "drift")
    base = f"/namespaces/{objects.ns}"
    objects._call("DELETE", f"/api/v1{base}/services/drift")
    objects._call("DELETE", f"/apis/{pdb_version}{base}/poddisruptionbudgets/drift")
    objects._call("PATCH", f"/apis/apps/v1{base}/statefulsets/drift/scale", {"spec": {"replicas": 5}},
                  "application/merge-patch+json")
    objects._call("PATCH", f"/apis/apps/v1{base}/statefulsets/drift", {"spec": {"template": {"spec": {"containers": [
        {"name": "engine", "image": "someone/else:latest"}]}}}}, "application/strategic-merge-patch+json")

    def repaired():
        sts = objects.get("apps/v1", "statefulsets", "drift")
        new_svc = objects.get("v1", "services", "drift")
        new_pdb = objects.get(pdb_version, "poddisruptionbudgets", "drift")
        return (new_svc and new_svc["metadata"]["uid"] != svc["metadata"]["uid"]
                and new_pdb and new_pdb["metadata"]["uid"] != pdb["metadata"]["uid"]
                and sts["spec"]["replicas"] == 1
                and sts["spec"]["template"]["spec"]["containers"][0]["image"] == s.DEFAULT_ENGINE_IMAGE)

    wait_for(repaired, 20, what="children restored",
             show=lambda: (objects.get("apps/v1", "statefulsets", "drift")["spec"],
                           objects.get("v1", "services", "drift"),
                           objects.get(pdb_version, "poddisruptionbudgets", "drift")))
    # and it settles: no endless re-applying
    time.sleep(2)
    rv = objects.get("apps/v1", "statefulsets", "drift")["metadata"]["resourceVersion"]
    time.sleep(2)
    assert objects.get("apps/v1", "statefulsets", "drift")["metadata"]["resourceVersion"] == rv
    assert cr["metadata"]["uid"] == objects.llmd("drift")["metadata"]["uid"]


def test_refused_child_does_not_block_the_others(objects, run_operator):
    """Item 5, the steps that showed it: a modelCache.size change together with a model
    change gave a permanent ApplyFailed and the StatefulSet kept the old model (the claim was
    applied first and refused). Now the claim's refusal is reported (Synced=False, with the
    reason, and a Warning event), the StatefulSet moves to the new model, and undoing the size
    change clears it."""
    run_operator()
    objects.create_llmd("resize", {"model": {"hub": "org/old"}, "gpu": {"count": 0},
                                   "modelCache": {"mode": "Shared", "size": "20Gi"}})
    wait_for(lambda: reconciled(objects, "resize"), 30, what="reconciled")
    objects.patch_llmd_spec("resize", {"model": {"hub": "org/new"}, "modelCache": {"size": "30Gi"}})

    def serving_new():
        sts = objects.get("apps/v1", "statefulsets", "resize")
        return "/models/hub/org/new" in sts["spec"]["template"]["spec"]["containers"][0]["args"]

    wait_for(serving_new, 30, what="StatefulSet on the new model", show=lambda: objects.llmd("resize").get("status"))
    cr = wait_for(lambda: cond(c := objects.llmd("resize"), "Synced").get("status") == "False" and c, 30,
                  what="Synced=False", show=lambda: objects.llmd("resize").get("status"))
    message = cond(cr, "Synced")["message"]
    assert "modelCache.size cannot change from 20Gi to 30Gi" in message and "allowVolumeExpansion" in message, message
    assert cond(cr, "Ready")["reason"] != "ApplyFailed"  # the workload is there; what serves is reported
    assert objects.get("v1", "persistentvolumeclaims", "resize-model-cache")["spec"]["resources"]["requests"][
        "storage"] == "20Gi"
    wait_for(lambda: any(e["reason"] == "ApplyFailed" and e["type"] == "Warning" and "modelCache.size" in e["message"]
                         for e in objects.events("resize")), 30, what="an ApplyFailed Warning event")
    objects.patch_llmd_spec("resize", {"modelCache": {"size": "20Gi"}})
    wait_for(lambda: cond(objects.llmd("resize"), "Synced").get("status") == "True", 30, what="Synced=True again",
             show=lambda: objects.llmd("resize").get("status"))


def test_cache_mode_change_recreates_statefulset(objects, run_operator):
    """Item 4 (#20): a shared claim becomes a claim per replica. volumeClaimTemplates cannot
    change in place: the StatefulSet is re-created (its pods left running, then replaced by
    the rollout), and the new per-replica claims belong to the LLMDeployment."""
    run_operator()
    objects.create_llmd("cache", {"model": {"hub": "a/b"}, "gpu": {"count": 0}, "modelCache": {"mode": "Shared"}})
    wait_for(lambda: reconciled(objects, "cache"), 30, what="reconciled")
    old = objects.get("apps/v1", "statefulsets", "cache")
    assert "volumeClaimTemplates" not in old["spec"]
    assert objects.get("v1", "persistentvolumeclaims", "cache-model-cache")
    objects.patch_llmd_spec("cache", {"modelCache": {"mode": "PerReplica"}})
    new = wait_for(lambda: (x := objects.get("apps/v1", "statefulsets", "cache")) and x["metadata"]["uid"] !=
                   old["metadata"]["uid"] and x, 30, what="StatefulSet re-created",
                   show=lambda: objects.llmd("cache").get("status"))
    assert new["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "model-cache"
    wait_for(lambda: cond(objects.llmd("cache"), "Synced").get("status") == "True", 30, what="Synced")
    claim = wait_for(lambda: (c := objects.get("v1", "persistentvolumeclaims", "model-cache-cache-0"))
                     and c["metadata"].get("ownerReferences") and c, 30, what="per-replica claim adopted")
    assert claim["metadata"]["ownerReferences"][0]["uid"] == objects.llmd("cache")["metadata"]["uid"]
    # kopf posts events from a queue of its own, so the event can trail the status it reports
    wait_for(lambda: any("re-created StatefulSet cache" in e["message"] for e in objects.events("cache")
                         if e["reason"] == "Applied"), 30, what="an Applied event naming the re-creation",
             show=lambda: [e["message"] for e in objects.events("cache")])
