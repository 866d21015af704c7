"""Pure builders and status computation: no cluster needed."""
from __future__ import annotations

from kvship_operator import builders as b
from kvship_operator import spec as s
from kvship_operator import status as st
from kvship_operator.schema import parse

OWNER = b.Owner("qwen", "team-a", "uid-123")


def build(**spec):
    spec.setdefault("model", {"hub": "Qwen/Qwen3-0.6B"})
    parsed = parse(s.LLMDeploymentSpec, spec)
    return parsed, {(o["kind"], o["metadata"]["name"]): o for o in b.build(OWNER, parsed)}


def test_children_and_owner_references():
    _, objs = build(modelCache={"mode": "Shared"})
    assert set(objs) == {
        ("PersistentVolumeClaim", "qwen-model-cache"),
        ("Service", "qwen"),
        ("Service", "qwen-engines"),
        ("PodDisruptionBudget", "qwen"),
        ("StatefulSet", "qwen"),
    }
    for o in objs.values():
        ref = o["metadata"]["ownerReferences"][0]
        assert ref == {"apiVersion": "kvship.io/v1alpha1", "kind": "LLMDeployment", "name": "qwen", "uid": "uid-123",
                       "controller": True, "blockOwnerDeletion": True}
        assert o["metadata"]["namespace"] == "team-a"
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvship-operator"


def test_statefulset_engine_container():
    _, objs = build(tensorParallelSize=2, replicas=3, engine={"args": ["--max-num-seqs", "64"]},
                    resources={"requests": {"cpu": "8", "memory": "64Gi"}})
    sts = objs[("StatefulSet", "qwen")]
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == "qwen-engines"
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    c = pod["containers"][0]
    assert c["command"] == ["kvship"]
    assert c["args"][:2] == ["serve", "/models/hub/Qwen/Qwen3-0.6B"]
    args = c["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--served-model-name") + 1] == "Qwen/Qwen3-0.6B"
    assert args[args.index("--port") + 1] == "8000" and args[args.index("--host") + 1] == "0.0.0.0"
    assert args[-2:] == ["--max-num-seqs", "64"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    # probes: readiness/liveness on /health, startup allows the whole startup timeout
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    sp = c["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 1800
    # security
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # volumes: shm in memory, a cache claim per replica, writable /tmp
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "model-cache" not in vols
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "model-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts and "/tmp" in mounts and mounts["/models"]["readOnly"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_HOME"]["value"] == "/models/hf" and env["HF_HUB_OFFLINE"]["value"] == "1"


def test_fetch_init_container_hub_with_token():
    _, objs = build(model={"hub": "meta-llama/Llama-3.1-8B", "revision": "main", "tokenSecret": {"name": "hf"}},
                    downloadTimeoutSeconds=900)
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    assert init["name"] == "fetch-model"
    assert init["command"] == ["python", "-m", "kvship_operator.fetch"]
    assert init["args"] == ["--hub", "meta-llama/Llama-3.1-8B", "--revision", "main",
                            "--dest", "/models/hub/meta-llama/Llama-3.1-8B@main", "--timeout", "900"]
    env = {e["name"]: e for e in init["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["containers"][0]["args"][1] == "/models/hub/meta-llama/Llama-3.1-8B@main"


def test_url_and_pvc_sources():
    spec, objs = build(model={"url": "https://example.invalid/models/small.gguf"})
    path = b.model_path(spec)
    assert path.startswith("/models/url/") and path.endswith("/small.gguf")
    init = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][:2] == ["--url", "https://example.invalid/models/small.gguf"]
    spec, _ = build(model={"url": "https://example.invalid/m.tar.gz"})
    assert not b.model_path(spec).endswith(".tar.gz")

    spec, objs = build(model={"pvc": {"claimName": "weights", "path": "llama/8b"}}, servedModelName="llama-8b",
                       modelCache={"enabled": False})
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-source"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert vols["model-cache"] == {"name": "model-cache", "emptyDir": {}}
    assert pod["containers"][0]["args"][1] == "/model-src/llama/8b"
    assert ("PersistentVolumeClaim", "qwen-model-cache") not in objs


def test_cache_claim_and_existing_claim():
    """Item 4 (#20): one ReadWriteOnce claim was shared by every replica (replicas on a second
    node could not mount it). Per replica by default; Shared is one ReadWriteMany claim."""
    _, objs = build(modelCache={"mode": "Shared", "size": "200Gi", "storageClassName": "fast"})
    pvc = objs[("PersistentVolumeClaim", "qwen-model-cache")]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
                           "storageClassName": "fast"}
    _, objs = build(modelCache={"existingClaim": "shared-models"})
    assert ("PersistentVolumeClaim", "qwen-model-cache") not in objs
    vols = {v["name"]: v for v in objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "shared-models"
    assert "volumeClaimTemplates" not in objs[("StatefulSet", "qwen")]["spec"]
    _, objs = build()
    assert ("PersistentVolumeClaim", "qwen-model-cache") not in objs
    assert objs[("StatefulSet", "qwen")]["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "model-cache"
    import pytest

    from kvship_operator.schema import SpecError

    with pytest.raises(SpecError, match="accessMode must be ReadWriteMany"):
        parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"},
                                    "modelCache": {"mode": "Shared", "accessMode": "ReadWriteOnce"}})
    with pytest.raises(SpecError, match="mode must be Shared"):
        parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"},
                                    "modelCache": {"mode": "PerReplica", "existingClaim": "x"}})


def test_scheduling_fields_and_cpu_mode():
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    _, objs = build(nodeSelector={"pool": "gpu"}, tolerations=tol, affinity=aff, gpu={"count": 0},
                    imagePullSecrets=[{"name": "regcred"}], priorityClassName="llm")
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["tolerations"] == tol and pod["affinity"] == aff
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["priorityClassName"] == "llm"
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}}  # CPU: no GPU request


def test_services_and_pdb():
    _, objs = build(service={"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}})
    svc = objs[("Service", "qwen")]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert svc["metadata"]["annotations"] == {"a": "b"}
    headless = objs[("Service", "qwen-engines")]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    pdb = objs[("PodDisruptionBudget", "qwen")]
    # a drain never takes the last serving replica (issue #20, item 3), one at a time otherwise
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1
    assert [b.min_available(parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "replicas": n}))
            for n in (0, 1, 2, 3, 8)] == [0, 1, 1, 2, 7]
    parsed = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}})
    assert b.pod_disruption_budget(OWNER, parsed, "policy/v1beta1")["apiVersion"] == "policy/v1beta1"
    assert b.endpoint(OWNER, parsed) == "http://qwen.team-a.svc.cluster.local:8000/v1"


# ------------------------------------------------------------------------------------------
# status


def _sts(replicas=2, ready=0, generation=1, observed=1, revision="r1"):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "observedGeneration": observed,
                       "updatedReplicas": replicas, "updateRevision": revision}}


def _pod(name="qwen-0", ready=False, revision="r1", **status):
    if ready:
        status.setdefault("conditions", []).append({"type": "Ready", "status": "True"})
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": {"controller-revision-hash": revision}},
            "status": status}


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


SPEC = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 2})


def test_status_ready_when_all_replicas_ready():
    done = [{"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}]
    pods = [_pod(f"qwen-{i}", ready=True, initContainerStatuses=done) for i in range(2)]
    out = st.compute(OWNER, SPEC, sts=_sts(ready=2), pods=pods, previous=None, observed_generation=4,
                     now="2025-01-01T00:00:00Z", served={"qwen-0": "Qwen/Qwen3-0.6B", "qwen-1": "Qwen/Qwen3-0.6B"})
    c = conds(out)
    assert c["Ready"]["status"] == "True" and c["WorkloadReady"]["reason"] == "AllReplicasReady"
    assert c["ModelCached"]["status"] == "True"
    assert all(x["observedGeneration"] == 4 and x["lastTransitionTime"] == "2025-01-01T00:00:00Z" for x in c.values())
    assert out["readyReplicas"] == 2 and out["observedGeneration"] == 4
    assert out["selector"] == "app.kubernetes.io/name=kvship-engine,kvship.io/llmdeployment=qwen"
    assert out["servedModelName"] == "Qwen/Qwen3-0.6B" and out["servingModel"] == "Qwen/Qwen3-0.6B"
    assert c["Progressing"]["status"] == "False" and c["Progressing"]["reason"] == "Complete"


def test_status_reports_what_pods_serve_during_a_rollout():
    """Item 2 (#20): after a model change the only ready pod still served the old model while
    the MODEL column showed the new one, Ready was True and ModelCached said "Downloaded <new
    model>". Status now comes from the pods: what each ready pod serves, which spec it runs."""
    old_done = [{"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}]
    new_spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "org/new"}})
    pods = [_pod("qwen-0", ready=True, revision="r1", initContainerStatuses=old_done),  # the old spec, serving
            _pod("qwen-1", revision="r2", initContainerStatuses=[  # the surge pod: downloading
                {"name": "fetch-model", "state": {"running": {"startedAt": "T"}}}])]
    out = st.compute(OWNER, new_spec, sts=_sts(replicas=2, ready=1, revision="r2"), pods=pods, previous=None,
                     observed_generation=2, served={"qwen-0": "org/old"})
    c = conds(out)
    assert out["servingModel"] == "org/old" and out["servedModelName"] == "org/new"
    assert (out["readyReplicas"], out["updatedReplicas"], out["updatedReadyReplicas"]) == (1, 1, 0)
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "ServingPreviousSpec"
    assert c["ModelCached"]["reason"] == "Downloading"  # not the old pod's download
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "RollingOut"
    assert all(x["observedGeneration"] == 2 for x in c.values())


def test_progressing_complete_only_when_nothing_is_left_to_change():
    """Issue 58 item 1: in a one-replica update Progressing said Complete when the surge pod
    became ready (the old pod terminating, the StatefulSet at 2), went back to Scaling, and
    said Complete again while the surge pod drained. Each step of that update now says True;
    only the end says Complete."""
    one = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 1})

    def progressing(pods, replicas, counts=None, revision="r2"):
        sts = _sts(replicas=replicas, revision=revision)
        if counts is not None:
            sts["status"].update(zip(("replicas", "updatedReplicas", "readyReplicas"), counts))
        return conds(st.compute(OWNER, one, sts=sts, pods=pods, previous=None, observed_generation=2))["Progressing"]

    def gone(pod):
        pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        return pod

    steps = {
        "surge pod ready, old pod terminating": progressing(
            [gone(_pod("qwen-0", ready=True, revision="r1")), _pod("qwen-1", ready=True, revision="r2")], 2, (2, 1, 2)),
        "old pod re-created on the new spec, loading": progressing(
            [_pod("qwen-0", revision="r2"), _pod("qwen-1", ready=True, revision="r2")], 2, (2, 2, 1)),
        "both ready, surge not yet scaled away": progressing(
            [_pod("qwen-0", ready=True, revision="r2"), _pod("qwen-1", ready=True, revision="r2")], 2, (2, 2, 2)),
        "surge pod draining": progressing(
            [_pod("qwen-0", ready=True, revision="r2"), gone(_pod("qwen-1", ready=True, revision="r2"))], 1, (2, 2, 2)),
        "surge pod gone, the controller's counts not yet": progressing(
            [_pod("qwen-0", ready=True, revision="r2")], 1, (2, 1, 1)),
    }
    for step, c in steps.items():
        assert c["status"] == "True" and c["reason"] != "Complete", (step, c)
    assert steps["surge pod ready, old pod terminating"]["reason"] == "RollingOut"
    assert "qwen-0 terminating" in steps["surge pod ready, old pod terminating"]["message"]
    assert "qwen-1 terminating" in steps["surge pod draining"]["message"]
    done = progressing([_pod("qwen-0", ready=True, revision="r2")], 1, (1, 1, 1))
    assert done["status"] == "False" and done["reason"] == "Complete", done
    # the controller has not seen the template yet: nothing can be said
    sts = _sts(replicas=1, generation=3, observed=2, revision="r2")
    c = conds(st.compute(OWNER, one, sts=sts, pods=[_pod("qwen-0", ready=True, revision="r2")], previous=None,
                         observed_generation=2))["Progressing"]
    assert c["status"] == "True" and c["reason"] == "Pending"


def test_status_insufficient_gpu():
    pod = _pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    c = conds(st.compute(OWNER, SPEC, sts=_sts(), pods=[pod], previous=None, observed_generation=1))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "InsufficientGPU"
    assert "Insufficient nvidia.com/gpu" in c["WorkloadReady"]["message"]


def test_status_download_failed():
    pod = _pod(initContainerStatuses=[{"name": "fetch-model", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                       "lastState": {"terminated": {"exitCode": 1, "message": "download of x failed: 401"}}}])
    c = conds(st.compute(OWNER, SPEC, sts=_sts(), pods=[pod], previous=None, observed_generation=1))
    assert c["ModelCached"]["status"] == "False" and c["ModelCached"]["reason"] == "DownloadFailed"
    assert "401" in c["ModelCached"]["message"]
    assert c["Ready"]["reason"] == "DownloadFailed"


def test_status_image_pull_and_crashloop():
    pod = _pod(containerStatuses=[{"name": "engine", "state": {"waiting": {"reason": "ImagePullBackOff",
                                                                          "message": "not found"}}}])
    c = conds(st.compute(OWNER, SPEC, sts=_sts(), pods=[pod], previous=None, observed_generation=1))
    assert c["Ready"]["reason"] == "ImagePullFailed"
    pod = _pod(containerStatuses=[{"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                   "lastState": {"terminated": {"exitCode": 1, "message": "CUDA out of memory"}}}])
    c = conds(st.compute(OWNER, SPEC, sts=_sts(), pods=[pod], previous=None, observed_generation=1))
    assert c["Ready"]["reason"] == "EngineCrashing" and "CUDA out of memory" in c["Ready"]["message"]


def test_status_transition_time_kept_until_status_changes():
    first = st.compute(OWNER, SPEC, sts=_sts(ready=0), pods=[_pod("qwen-0"), _pod("qwen-1")], previous=None,
                       observed_generation=1, now="T1")
    second = st.compute(OWNER, SPEC, sts=_sts(ready=1), pods=[_pod("qwen-0", ready=True), _pod("qwen-1")],
                        previous=first, observed_generation=1, now="T2")
    assert conds(second)["Ready"]["status"] == "True" and conds(second)["Ready"]["reason"] == "PartiallyServing"
    assert conds(second)["Ready"]["lastTransitionTime"] == "T2"
    assert conds(second)["WorkloadReady"]["lastTransitionTime"] == "T1"  # still False
    zero = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "replicas": 0})
    c = conds(st.compute(OWNER, zero, sts=_sts(replicas=0), pods=[], previous=None, observed_generation=1))
    assert c["Ready"]["reason"] == "ScaledToZero"


def test_status_failed_spec():
    out = st.failed(None, "InvalidSpec", "spec: bad", 3, now="T")
    assert out["conditions"] == [{"type": "Ready", "status": "False", "reason": "InvalidSpec", "message": "spec: bad",
                                  "lastTransitionTime": "T", "observedGeneration": 3}]


def test_longest_name_gives_valid_child_names():
    """Item 7 (#20): a 58-character name was accepted and its children's names were invalid.
    At the longest name the CRD allows, every child name, the pod names the StatefulSet
    controller derives (ordinals up to 99) and its controller-revision-hash label value
    ("<statefulset>-<hash of up to 10>") are valid."""
    import re

    dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    dns1123_label = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    name = "a" * s.MAX_NAME_LENGTH
    owner = b.Owner(name, "team-a", "uid")
    spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 100})
    for obj in b.build(owner, spec):
        child = obj["metadata"]["name"]
        if obj["kind"] == "Service":
            assert dns1035.match(child) and len(child) <= 63, child
        assert dns1123_label.match(child) and len(child) <= 63, child
        for value in obj["metadata"]["labels"].values():
            assert len(value) <= 63, value
        if obj["kind"] == "StatefulSet":
            for derived in (f"{child}-99", f"{child}-{'f' * 10}"):
                assert dns1123_label.match(derived) and len(derived) <= 63, derived


def test_resource_name_rule():
    s.check_name("a" * s.MAX_NAME_LENGTH)
    for bad in ("a" * (s.MAX_NAME_LENGTH + 1), "qwen.v1", "1qwen", "Qwen"):
        try:
            s.check_name(bad)
        except Exception as e:  # noqa: BLE001
            assert "metadata.name" in str(e)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_tolerations_and_affinity_are_typed():
    """Item 7 (#20): tolerations/affinity were passed through unchecked. Their real schemas
    refuse a bad enum value, and what is built is exactly what was written (no defaults
    added: the server would not store empty lists, and the child would never match)."""
    import pytest

    from kvship_operator.schema import SpecError

    with pytest.raises(SpecError, match=r"spec.tolerations\[0\].effect"):
        parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "tolerations": [{"key": "k", "effect": "NoSchedul"}]})
    with pytest.raises(SpecError, match="topologyKey"):
        parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "affinity": {"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {"matchLabels": {"a": "b"}}}]}}})
    aff = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}}]}}
    _, objs = build(affinity=aff, tolerations=[{"operator": "Exists"}])
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    assert pod["affinity"] == aff and pod["tolerations"] == [{"operator": "Exists"}]


def test_default_requests_grace_period_and_prestop():
    """Item 10 (#20): no CPU/memory requests by default (GPU only), a fixed 60 s grace
    period and no preStop. Requests now come from the model size (or the GPU count), the
    grace period from shutdownTimeoutSeconds, and preStop keeps serving while endpoints
    update before the engine drains."""
    _, objs = build(tensorParallelSize=2)
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["requests"] == {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "2"}
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(b.PRESTOP_SECONDS)]}}
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == "30"
    assert pod["terminationGracePeriodSeconds"] == b.PRESTOP_SECONDS + 30 + b.GRACE_MARGIN_SECONDS

    # the model's size sizes memory: 16Gi of weights -> 16 * 1.25 + 4 = 24Gi
    _, objs = build(model={"hub": "meta-llama/Llama-3.1-8B-Instruct", "sizeHint": "16Gi"}, shutdownTimeoutSeconds=120)
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "24Gi"
    assert pod["terminationGracePeriodSeconds"] == b.PRESTOP_SECONDS + 120 + b.GRACE_MARGIN_SECONDS

    # what the spec says wins; a limit alone is not contradicted by a default request
    _, objs = build(resources={"requests": {"cpu": "16"}, "limits": {"memory": "12Gi"}})
    requests = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "16", "nvidia.com/gpu": "1"}


def test_rollout_plan_surges_then_replaces_one_pod_at_a_time():
    """Item 3 (#20): a one-replica update deleted the only ready pod 0.4 s after an args
    change. The plan: surge one pod on the new spec, and replace an old pod only once every
    pod is ready; old pods that serve nothing go at once."""
    from kvship_operator import rollout as r

    def pod(ordinal, revision, ready=True, terminating=False):
        return r.PodView(f"qwen-{ordinal}", f"u{ordinal}{revision}", ordinal, revision, ready, terminating)

    assert r.plan(1, "new", [pod(0, "new")]) == r.Plan(1)  # nothing to roll
    assert r.plan(1, None, [pod(0, "old")], current=1).replicas == 1  # revision not known yet: hold
    step = r.plan(1, "new", [pod(0, "old")])  # the change: surge first, delete nothing
    assert step.replicas == 2 and step.delete == [] and step.rolling
    step = r.plan(1, "new", [pod(0, "old"), pod(1, "new", ready=False)])  # surge pod loading
    assert step.replicas == 2 and step.delete == []
    step = r.plan(1, "new", [pod(0, "old"), pod(1, "new")])  # surge ready: replace the old pod
    assert step.replicas == 2 and [p.name for p in step.delete] == ["qwen-0"]
    step = r.plan(1, "new", [pod(0, "old", terminating=True), pod(1, "new")], current=2)  # it drains
    assert step.replicas == 2 and step.delete == []
    step = r.plan(1, "new", [pod(0, "new", ready=False), pod(1, "new")], current=2)  # its replacement loads
    assert step.replicas == 2 and step.delete == []
    assert r.plan(1, "new", [pod(0, "new"), pod(1, "new")], current=2) == r.Plan(1)  # done: the surge pod goes
    # a plain scale-down is not held
    assert r.plan(1, "new", [pod(0, "new", ready=False), pod(1, "new"), pod(2, "new")], current=3) == r.Plan(1)
    # an old pod that is not ready serves nothing: replaced at once (a broken spec gets fixed)
    step = r.plan(2, "new", [pod(0, "old", ready=False), pod(1, "old")])
    assert step.replicas == 3 and [p.name for p in step.delete] == ["qwen-0"]
    # two replicas: one at a time, never below two ready
    step = r.plan(2, "new", [pod(0, "old"), pod(1, "old"), pod(2, "new")])
    assert [p.name for p in step.delete] == ["qwen-1"]
    assert r.plan(2, "new", [pod(0, "old"), pod(1, "new", ready=False), pod(2, "new")]).delete == []


def test_edited_pod_template_is_repaired_without_a_rollout():
    """Issue 58 item 2: an image patched into the StatefulSet by hand was taken for a new
    revision and the surge replica was asked for. The operator knows its own template from
    the digest it leaves on the StatefulSet: an edit under an unchanged spec keeps the
    replicas it applied (no surge, no pod replaced); a changed spec plans as before."""
    import copy

    from kvship_operator import rollout as r
    from kvship_operator.apply import APPLIED_ANNOTATION, applied_digest

    spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 2})

    def live(replicas):
        obj = b.statefulset(OWNER, spec, replicas)
        out = copy.deepcopy(obj)
        out["metadata"]["annotations"] = {APPLIED_ANNOTATION: applied_digest(obj)}
        return out

    for applied in (2, 3):  # steady, or holding the surge of a rollout
        sts = live(applied)
        assert r.edited_template_replicas(sts, OWNER, spec) is None  # as applied: nothing to hold
        sts["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
        assert r.edited_template_replicas(sts, OWNER, spec) == applied
    changed = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 2,
                                          "engine": {"args": ["--max-num-seqs", "4"]}})
    assert r.edited_template_replicas(live(2), OWNER, changed) is None  # a spec change: a rollout
    assert r.edited_template_replicas(None, OWNER, spec) is None
