"""Pure builders: an `LLMDeployment` (name, namespace, uid, parsed spec) -> child manifests.

No API calls here: every function returns plain dicts, ready for server-side apply.
"""
from __future__ import annotations

import hashlib
import math
import posixpath
from dataclasses import dataclass
from typing import Any

from . import spec as s
from .schema import to_dict

FIELD_MANAGER = "kvship-operator"
MANAGED_BY = "kvship-operator"
INSTANCE_LABEL = "kvship.io/llmdeployment"
CACHE_MOUNT = "/models"
SOURCE_MOUNT = "/model-src"
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")
UID = 1000


@dataclass(frozen=True)
class Owner:
    """The LLMDeployment being reconciled."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": s.API_VERSION,
            "kind": s.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# ---------------------------------------------------------------------------------------
# names and labels


def selector_labels(owner: Owner) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvship-engine", INSTANCE_LABEL: owner.name}


def labels(owner: Owner) -> dict[str, str]:
    return {
        **selector_labels(owner),
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "kvship",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(owner).items()))


def headless_name(owner: Owner) -> str:
    return f"{owner.name}-engines"


def cache_claim_name(owner: Owner) -> str:
    return f"{owner.name}-model-cache"


def served_model_name(owner: Owner, spec: s.LLMDeploymentSpec) -> str:
    if spec.served_model_name:
        return spec.served_model_name
    if spec.model.hub:
        return spec.model.hub
    return owner.name


def endpoint(owner: Owner, spec: s.LLMDeploymentSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc.cluster.local:{spec.service.port}/v1"


def gpu_count(spec: s.LLMDeploymentSpec) -> int:
    return spec.tensor_parallel_size if spec.gpu.count is None else spec.gpu.count


def _meta(owner: Owner, name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner),
        "ownerReferences": [owner.reference()],
    }
    if extra:
        meta.update(extra)
    return meta


# ---------------------------------------------------------------------------------------
# model location


def model_path(spec: s.LLMDeploymentSpec) -> str:
    """What `kvship serve` is given: a folder (or file) inside the pod."""
    m = spec.model
    if m.pvc is not None:
        return posixpath.normpath(posixpath.join(SOURCE_MOUNT, m.pvc.path.lstrip("/"))) if m.pvc.path else SOURCE_MOUNT
    if m.hub is not None:
        sub = m.hub + (f"@{m.revision}" if m.revision else "")
        return f"{CACHE_MOUNT}/hub/{sub}"
    assert m.url is not None
    folder = f"{CACHE_MOUNT}/url/{hashlib.sha256(m.url.encode()).hexdigest()[:16]}"
    base = posixpath.basename(m.url.split("?", 1)[0].split("#", 1)[0]) or "model"
    if base.endswith(ARCHIVE_SUFFIXES):
        return folder
    return f"{folder}/{base}"


def _token_env(spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    ref = spec.model.token_secret
    if ref is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def fetch_container(spec: s.LLMDeploymentSpec) -> dict[str, Any] | None:
    """Init container downloading the model into the cache (None for a PVC source)."""
    m = spec.model
    if m.pvc is not None:
        return None
    args = ["--dest", model_path(spec), "--timeout", str(spec.download_timeout_seconds)]
    if m.hub is not None:
        args = ["--hub", m.hub] + (["--revision", m.revision] if m.revision else []) + args
    else:
        args = ["--url", m.url or ""] + args
    return {
        "name": "fetch-model",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["python", "-m", "kvship_operator.fetch"],
        "args": args,
        "env": [
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
            *_token_env(spec),
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": _container_security(),
    }


def engine_container(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    gpus = gpu_count(spec)
    if gpus > 0:
        # quantities as strings: server-side apply's typed patch refuses numbers here
        requests[spec.gpu.resource_name] = str(gpus)
        limits[spec.gpu.resource_name] = str(gpus)
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    startup_period = 10
    mounts = [
        {"name": "model-cache", "mountPath": CACHE_MOUNT, "readOnly": spec.model.pvc is None},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.model.pvc is not None:
        mounts[0]["readOnly"] = False
        mounts.append({"name": "model-source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    env = [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
        *_token_env(spec),
        *[to_dict(e) for e in spec.engine.env],
    ]
    container = {
        "name": "engine",
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["kvship"],
        "args": [
            "serve",
            model_path(spec),
            "--host",
            "0.0.0.0",
            "--port",
            str(s.ENGINE_PORT),
            "--served-model-name",
            served_model_name(owner, spec),
            "--tensor-parallel-size",
            str(spec.tensor_parallel_size),
            *spec.engine.args,
        ],
        "ports": [{"name": "http", "containerPort": s.ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "startupProbe": {
            **probe,
            "periodSeconds": startup_period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(spec.startup_timeout_seconds / startup_period)),
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 4},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    if resources:
        container["resources"] = resources
    return container


def volumes(owner: Owner, spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    cache = spec.model_cache
    if not cache.enabled:
        cache_volume: dict[str, Any] = {"name": "model-cache", "emptyDir": {}}
    else:
        claim = cache.existing_claim or cache_claim_name(owner)
        cache_volume = {"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}}
    out = [
        cache_volume,
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.model.pvc is not None:
        out.append(
            {"name": "model-source", "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True}}
        )
    return out


def statefulset(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": 60,
        "containers": [engine_container(owner, spec)],
        "volumes": volumes(owner, spec),
    }
    init = fetch_container(spec)
    if init is not None:
        pod_spec["initContainers"] = [init]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": r.name} for r in spec.image_pull_secrets]
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    template_meta: dict[str, Any] = {"labels": labels(owner)}
    if spec.pod_annotations:
        template_meta["annotations"] = dict(spec.pod_annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "replicas": spec.replicas,
            "serviceName": headless_name(owner),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": selector_labels(owner)},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def service(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    extra = {"annotations": dict(spec.service.annotations)} if spec.service.annotations else None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, owner.name, extra),
        "spec": {
            "type": spec.service.type,
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def headless_service(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, headless_name(owner)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": s.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner, spec: s.LLMDeploymentSpec, api_version: str = "policy/v1") -> dict[str, Any]:
    """At most one replica voluntarily disrupted at a time (model loads are slow)."""
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, owner.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}},
    }


def cache_claim(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any] | None:
    cache = spec.model_cache
    if not cache.enabled or cache.existing_claim:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(owner, cache_claim_name(owner)),
        "spec": claim_spec,
    }


# ---------------------------------------------------------------------------------------
# autoscaling objects (provider hpa / keda); the built-in provider needs none

# The per-pod metric an HPA reads through the custom metrics API: waiting + running requests.
# A metrics adapter must serve it (docs/autoscaling.md has a prometheus-adapter rule).
HPA_METRIC = "kvship:num_requests_waiting_plus_running"
KEDA_API_VERSION = "keda.sh/v1alpha1"
KEDA_CRD = "scaledobjects.keda.sh"


def scale_target(owner: Owner) -> dict[str, Any]:
    """The LLMDeployment's scale subresource (what the HPA / KEDA act on)."""
    return {"apiVersion": s.API_VERSION, "kind": s.KIND, "name": owner.name}


def _behavior(a: s.Autoscaling) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": a.scale_up_stabilization_seconds},
        "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds},
    }


def horizontal_pod_autoscaler(owner: Owner, spec: s.LLMDeploymentSpec,
                              api_version: str = "autoscaling/v2") -> dict[str, Any]:
    """An HPA on the average waiting + running requests per pod (a Pods metric)."""
    a = spec.autoscaling
    return {
        "apiVersion": api_version,
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "scaleTargetRef": scale_target(owner),
            "minReplicas": max(a.min_replicas, 1),
            "maxReplicas": max(a.max_replicas, a.min_replicas, 1),
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": HPA_METRIC},
                    "target": {"type": "AverageValue", "averageValue": str(a.target_requests_per_replica)},
                },
            }],
            "behavior": _behavior(a),
        },
    }


def keda_query(owner: Owner) -> str:
    """PromQL: waiting + running requests over this LLMDeployment's pods (the usual
    Kubernetes service-discovery labels `namespace` and `pod`)."""
    match = f'namespace="{owner.namespace}",pod=~"{owner.name}-[0-9]+"'
    return (f"sum(kvship:num_requests_waiting{{{match}}} or vector(0)) + "
            f"sum(kvship:num_requests_running{{{match}}} or vector(0))")


def scaled_object(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    """A KEDA ScaledObject with a Prometheus trigger (threshold = target per replica)."""
    a = spec.autoscaling
    return {
        "apiVersion": KEDA_API_VERSION,
        "kind": "ScaledObject",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "scaleTargetRef": scale_target(owner),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": max(a.max_replicas, a.min_replicas),
            "pollingInterval": a.interval_seconds,
            "cooldownPeriod": a.scale_down_stabilization_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(a)}},
            "triggers": [{
                "type": "prometheus",
                "metadata": {
                    "serverAddress": a.prometheus_server_address or "",
                    "query": keda_query(owner),
                    "threshold": str(a.target_requests_per_replica),
                },
            }],
        },
    }


def autoscaling_object(owner: Owner, spec: s.LLMDeploymentSpec, *,
                       hpa_api_version: str = "autoscaling/v2") -> dict[str, Any] | None:
    """The HPA or ScaledObject the spec asks for, or None (disabled or built-in)."""
    a = spec.autoscaling
    if not a.enabled or a.provider == "builtin":
        return None
    if a.provider == "hpa":
        return horizontal_pod_autoscaler(owner, spec, hpa_api_version)
    return scaled_object(owner, spec)


def build(owner: Owner, spec: s.LLMDeploymentSpec, *, pdb_api_version: str = "policy/v1") -> list[dict[str, Any]]:
    """All children, in apply order (claim before the pods that mount it)."""
    out = []
    claim = cache_claim(owner, spec)
    if claim is not None:
        out.append(claim)
    out += [
        headless_service(owner, spec),
        service(owner, spec),
        pod_disruption_budget(owner, spec, pdb_api_version),
        statefulset(owner, spec),
    ]
    return out
