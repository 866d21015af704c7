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
    _, objs = build()
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
    # volumes: shm in memory, cache PVC, writable /tmp
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "qwen-model-cache"
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
    _, objs = build(modelCache={"size": "200Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"})
    pvc = objs[("PersistentVolumeClaim", "qwen-model-cache")]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
                           "storageClassName": "fast"}
    _, objs = build(modelCache={"existingClaim": "shared-models"})
    assert ("PersistentVolumeClaim", "qwen-model-cache") not in objs
    vols = {v["name"]: v for v in objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "shared-models"


def test_scheduling_fields_and_cpu_mode():
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    aff = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    _, objs = build(nodeSelector={"pool": "gpu"}, tolerations=tol, affinity=aff, gpu={"count": 0},
                    imagePullSecrets=[{"name": "regcred"}], priorityClassName="llm")
    pod = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["tolerations"] == tol and pod["affinity"] == aff
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["priorityClassName"] == "llm"
    assert "resources" not in pod["containers"][0]  # CPU: no GPU request


def test_services_and_pdb():
    _, objs = build(service={"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"}})
    svc = objs[("Service", "qwen")]
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert svc["metadata"]["annotations"] == {"a": "b"}
    headless = objs[("Service", "qwen-engines")]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    pdb = objs[("PodDisruptionBudget", "qwen")]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    parsed = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}})
    assert b.pod_disruption_budget(OWNER, parsed, "policy/v1beta1")["apiVersion"] == "policy/v1beta1"
    assert b.endpoint(OWNER, parsed) == "http://qwen.team-a.svc.cluster.local:8000/v1"


# ------------------------------------------------------------------------------------------
# status


def _sts(replicas=2, ready=0, generation=1, observed=1):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "observedGeneration": observed,
                       "updatedReplicas": replicas}}


def _pod(name="qwen-0", **status):
    return {"metadata": {"name": name}, "status": status}


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


SPEC = parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "replicas": 2})


def test_status_ready_when_all_replicas_ready():
    out = st.compute(OWNER, SPEC, sts=_sts(ready=2), pods=[_pod(initContainerStatuses=[
        {"name": "fetch-model", "state": {"terminated": {"exitCode": 0}}}])], previous=None,
        observed_generation=4, now="2025-01-01T00:00:00Z")
    c = conds(out)
    assert c["Ready"]["status"] == "True" and c["WorkloadReady"]["reason"] == "AllReplicasReady"
    assert c["ModelCached"]["status"] == "True"
    assert all(x["observedGeneration"] == 4 and x["lastTransitionTime"] == "2025-01-01T00:00:00Z" for x in c.values())
    assert out["readyReplicas"] == 2 and out["observedGeneration"] == 4
    assert out["selector"] == "app.kubernetes.io/name=kvship-engine,kvship.io/llmdeployment=qwen"
    assert out["servedModelName"] == "Qwen/Qwen3-0.6B"


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
    first = st.compute(OWNER, SPEC, sts=_sts(ready=0), pods=[], previous=None, observed_generation=1, now="T1")
    second = st.compute(OWNER, SPEC, sts=_sts(ready=1), pods=[], previous=first, observed_generation=1, now="T2")
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
