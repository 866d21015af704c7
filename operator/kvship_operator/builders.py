"""Pure builders: an `LLMDeployment` (name, namespace, uid, parsed spec) -> child manifests.

No API calls here: every function returns plain dicts, ready for server-side apply.
"""
from __future__ import annotations

import hashlib
import json
import math
import posixpath
from dataclasses import dataclass
from typing import Any

from . import adapters, engine_args
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


ROLE_LABEL = "kvship.io/role"
GROUP_LABEL = "kvship.io/group"
RENDEZVOUS_PORT = 29500  # MASTER_PORT: where a group's leader (rank 0) listens for its workers


def multi_node(spec: s.LLMDeploymentSpec) -> bool:
    return spec.nodes_per_replica > 1


def selector_labels(owner: Owner) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvship-engine", INSTANCE_LABEL: owner.name}


def traffic_labels(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, str]:
    """The pods that serve: every replica, or the leaders of multi-node groups."""
    return {**selector_labels(owner), ROLE_LABEL: "leader"} if multi_node(spec) else selector_labels(owner)


ROUTER_APP = "kvship-router"


def router_selector_labels(owner: Owner) -> dict[str, str]:
    """The router's pods (spec.routing): never matched by the engines' selectors."""
    return {"app.kubernetes.io/name": ROUTER_APP, INSTANCE_LABEL: owner.name}


def worker_labels(owner: Owner, leader: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvship-engine-worker",  # never matched by the leaders' selectors
        INSTANCE_LABEL: owner.name,
        GROUP_LABEL: leader,
        ROLE_LABEL: "worker",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "engine-worker",
        "app.kubernetes.io/part-of": "kvship",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


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
    """Accelerators per pod (a multi-node replica's are spread over its pods)."""
    per_replica = spec.tensor_parallel_size if spec.gpu.count is None else spec.gpu.count
    return per_replica // spec.nodes_per_replica


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


# Before the engine gets SIGTERM, preStop waits this long while it still serves: Services and
# load balancers take a few seconds to drop a terminating pod from their endpoints, and
# requests routed to it meanwhile must not fail. Then the engine drains (readiness false, no
# new work, in-flight requests get spec.shutdownTimeoutSeconds).
PRESTOP_SECONDS = 10
GRACE_MARGIN_SECONDS = 15
GiB = 1 << 30


def termination_grace_seconds(spec: s.LLMDeploymentSpec) -> int:
    return PRESTOP_SECONDS + spec.shutdown_timeout_seconds + GRACE_MARGIN_SECONDS


def quantity_bytes(q: str) -> float:
    """A quantity ("16Gi", "500M", "1.5e9", "100m") as a number of base units."""
    text = str(q).strip()
    for suffix, factor in (("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40), ("Pi", 1 << 50),
                           ("Ei", 1 << 60), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12), ("P", 1e15),
                           ("E", 1e18), ("m", 1e-3), ("n", 1e-9), ("u", 1e-6)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def default_requests(spec: s.LLMDeploymentSpec) -> dict[str, str]:
    """CPU and memory requests when the spec gives neither a request nor a limit for them:
    a replica needs host memory for the weights while it loads them (plus the runtime) and a
    few cores for the HTTP server, tokenizing and the engine loop."""
    gpus = gpu_count(spec)
    if spec.model.size_hint is not None:
        share = quantity_bytes(spec.model.size_hint) / spec.nodes_per_replica  # each pod loads its shard
        memory = math.ceil((share * 1.25 + 4 * GiB) / GiB)
    else:
        memory = 16 * gpus if gpus else 8
    return {"cpu": str(2 + gpus if gpus else 4), "memory": f"{memory}Gi"}


def group_env(owner: Owner, spec: s.LLMDeploymentSpec, leader: str | None) -> list[dict[str, Any]]:
    """The engine's cross-host tensor-parallel environment (docs/tensor-parallel.md) for a pod
    of a multi-node group: the leader (``leader`` None) is host 0 and listens at its own
    address; a worker finds it through the headless Service and takes its host rank from its
    pod ordinal (see worker_container)."""
    if not multi_node(spec):
        return []
    dns = f"{headless_name(owner)}.{owner.namespace}.svc"
    out: list[dict[str, Any]] = [{"name": "KVSHIP_NNODES", "value": str(spec.nodes_per_replica)},
                                 {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)}]
    if leader is None:
        out = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
               {"name": "MASTER_ADDR", "value": f"$(POD_NAME).{dns}"},
               {"name": "KVSHIP_NODE_RANK", "value": "0"}, *out]
    else:
        out = [{"name": "MASTER_ADDR", "value": f"{leader}.{dns}"}, *out]
    return out


KV_EVENTS_PORT = 5557  # where a routed engine publishes its KV-cache events (ZMQ PUB), for the router


def kv_events(spec: s.LLMDeploymentSpec) -> bool:
    return spec.routing.mode != "service" and spec.routing.kv_events


def kv_events_config() -> str:
    """The engine's --kv-events-config (vLLM's KVEventsConfig as JSON)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}"},
                      separators=(",", ":"))


def engine_container(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    requests = dict(spec.resources.requests)
    limits = dict(spec.resources.limits)
    for key, value in default_requests(spec).items():
        if key not in requests and key not in limits:  # a limit alone makes the request equal to it
            requests[key] = value
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
    # `readOnly: false` is left out, never written: the server does not store a false
    # boolean here, so an object that says it would never match what the server keeps
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": CACHE_MOUNT},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.model.pvc is None:
        mounts[0]["readOnly"] = True
    else:
        mounts.append({"name": "model-source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    mounts += adapters.mounts(spec)
    env = [
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/hf"},
        # hub adapters are downloaded by the engine when they are loaded
        {"name": "HF_HUB_OFFLINE", "value": "0" if spec.adapters else "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/cache"},
        *_token_env(spec),
        *adapters.engine_env(spec),
        *group_env(owner, spec, None),
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
            "--shutdown-timeout",
            str(spec.shutdown_timeout_seconds),
            *(["--kv-events-config", kv_events_config()] if kv_events(spec) else []),
            *adapters.engine_args(spec, engine_args.given(spec.engine.args)),
            *spec.engine.args,
        ],
        "ports": [{"name": "http", "containerPort": s.ENGINE_PORT, "protocol": "TCP"}]
        + ([{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}] if multi_node(spec) else [])
        + ([{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}] if kv_events(spec) else []),
        "env": env,
        "startupProbe": {
            **probe,
            "periodSeconds": startup_period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(spec.startup_timeout_seconds / startup_period)),
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 4},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": mounts,
        "securityContext": _container_security(),
    }
    if resources:
        container["resources"] = resources
    return container


def per_replica_cache(spec: s.LLMDeploymentSpec) -> bool:
    return spec.model_cache.enabled and not spec.model_cache.shared


def per_replica_claim_prefix(owner: Owner) -> str:
    """Claims of volumeClaimTemplates are named "<template>-<statefulset>-<ordinal>"."""
    return f"model-cache-{owner.name}-"


def volumes(owner: Owner, spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    cache = spec.model_cache
    out: list[dict[str, Any]] = []
    if not cache.enabled:
        out.append({"name": "model-cache", "emptyDir": {}})
    elif cache.shared:
        claim = cache.existing_claim or cache_claim_name(owner)
        out.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": claim}})
    # (per replica: the claim comes from the StatefulSet's volumeClaimTemplates)
    out += [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.model.pvc is not None:
        out.append(
            {"name": "model-source", "persistentVolumeClaim": {"claimName": spec.model.pvc.claim_name, "readOnly": True}}
        )
    out += adapters.volumes(spec)
    return out


def statefulset(owner: Owner, spec: s.LLMDeploymentSpec, replicas: int | None = None) -> dict[str, Any]:
    """``replicas``: what the rollout needs now (spec.replicas, + 1 while pods of an older
    spec are being replaced: see rollout.py)."""
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            # a large cache is not walked to change ownership at every start, only when its root differs
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "containers": [engine_container(owner, spec)],
        "volumes": volumes(owner, spec),
    }
    init = fetch_container(spec)
    if init is not None:
        pod_spec["initContainers"] = [init]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = to_dict(spec.tolerations)
    if spec.affinity:
        pod_spec["affinity"] = to_dict(spec.affinity)
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": r.name} for r in spec.image_pull_secrets]
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    template_meta: dict[str, Any] = {"labels": {**labels(owner), **traffic_labels(owner, spec)}}
    if spec.pod_annotations:
        template_meta["annotations"] = dict(spec.pod_annotations)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "serviceName": headless_name(owner),
            "podManagementPolicy": "Parallel",
            # the operator replaces pods itself, surging first (rollout.py): a rolling update
            # by the StatefulSet controller would delete the only ready replica first
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector_labels(owner)},
            "template": {"metadata": template_meta, "spec": pod_spec},
            **({"volumeClaimTemplates": claim_templates(owner, spec)} if per_replica_cache(spec) else {}),
        },
    }


def worker_container(owner: Owner, spec: s.LLMDeploymentSpec, leader: str) -> dict[str, Any]:
    """A group worker: the leader's command and arguments (each host loads its shard), no
    HTTP traffic or probes (the leader's readiness covers the group: it serves only once
    every rank has joined), its host rank from its pod ordinal: worker i is host i + 1."""
    c = engine_container(owner, spec)
    env = [e for e in c["env"] if e["name"] not in ("POD_NAME", "MASTER_ADDR", "KVSHIP_NODE_RANK")]
    keep = [e for e in env if e["name"] not in ("KVSHIP_NNODES", "MASTER_PORT")]
    c["env"] = [*keep, *group_env(owner, spec, leader)]
    c["command"] = ["sh", "-c", 'KVSHIP_NODE_RANK=$(( ${HOSTNAME##*-} + 1 )) exec kvship "$@"', "kvship"]
    c["ports"] = [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        c.pop(key, None)
    return c


def worker_statefulset(owner: Owner, spec: s.LLMDeploymentSpec, leader_pod: dict[str, Any]) -> dict[str, Any]:
    """The workers of the group whose leader is ``leader_pod``, owned by that pod (as in
    LeaderWorkerSet): they go when the leader goes (scale-down, a rollout replacing it, a
    restart of the group), and a new leader gets new workers built from the current spec."""
    leader = leader_pod["metadata"]["name"]
    sts = statefulset(owner, spec)
    pod = sts["spec"]["template"]["spec"]
    pod["containers"] = [worker_container(owner, spec, leader)]
    name = f"{leader}-w"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": worker_labels(owner, leader),
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": leader,
                                 "uid": leader_pod["metadata"]["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {
            **sts["spec"],
            "replicas": spec.nodes_per_replica - 1,
            "selector": {"matchLabels": {k: v for k, v in worker_labels(owner, leader).items()
                                         if k in ("app.kubernetes.io/name", INSTANCE_LABEL, GROUP_LABEL)}},
            "template": {"metadata": {**sts["spec"]["template"]["metadata"], "labels": worker_labels(owner, leader)},
                         "spec": pod},
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
            # mode envoy: the router's pods, which pick a replica per request
            "selector": router_selector_labels(owner) if spec.routing.mode == "envoy" else traffic_labels(owner, spec),
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
    """At most one replica voluntarily disrupted at a time (model loads are slow), and never
    the last one serving: a node drain waits rather than take the endpoint down."""
    return {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, owner.name),
        "spec": {"minAvailable": min_available(spec), "selector": {"matchLabels": traffic_labels(owner, spec)}},
    }


def min_available(spec: s.LLMDeploymentSpec) -> int:
    return max(1, spec.replicas - 1) if spec.replicas > 0 else 0


def _claim_spec(spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    cache = spec.model_cache
    claim_spec: dict[str, Any] = {
        "accessModes": [cache.effective_access_mode],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    return claim_spec


def claim_templates(owner: Owner, spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    """The per-replica cache claim (volumeClaimTemplates); the operator gives each created
    claim an owner reference to the LLMDeployment, so that they go away with it."""
    if not per_replica_cache(spec):
        return []
    return [{
        "metadata": {"name": "model-cache", "labels": labels(owner)},
        "spec": {**_claim_spec(spec), "volumeMode": "Filesystem"},
    }]


def cache_claim(owner: Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any] | None:
    cache = spec.model_cache
    if not cache.enabled or cache.existing_claim or not cache.shared:
        return None
    claim_spec = _claim_spec(spec)
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


# Requests a router holds (or queues) for want of a ready replica: what brings the first
# replica up at zero (scale_zero.py reads it from the router pods; KEDA through Prometheus).
ROUTER_PENDING_METRIC = "kvship_router:pending_requests"


def keda_query(owner: Owner, spec: s.LLMDeploymentSpec) -> str:
    """PromQL: waiting + running requests over this LLMDeployment's pods (the usual
    Kubernetes service-discovery labels `namespace` and `pod`), plus what its router holds."""
    match = f'namespace="{owner.namespace}",pod=~"{owner.name}-[0-9]+"'
    query = (f"sum(kvship:num_requests_waiting{{{match}}} or vector(0)) + "
             f"sum(kvship:num_requests_running{{{match}}} or vector(0))")
    if spec.routing.mode != "service":
        router = f'namespace="{owner.namespace}",pod=~"{owner.name}-router-.+"'
        query += f" + sum({ROUTER_PENDING_METRIC}{{{router}}} or vector(0))"
    return query


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
                    "query": keda_query(owner, spec),
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


def build(owner: Owner, spec: s.LLMDeploymentSpec, *, pdb_api_version: str = "policy/v1",
          replicas: int | None = None) -> list[dict[str, Any]]:
    """All children, in apply order (claim before the pods that mount it)."""
    out = []
    claim = cache_claim(owner, spec)
    if claim is not None:
        out.append(claim)
    out += [
        headless_service(owner, spec),
        service(owner, spec),
        pod_disruption_budget(owner, spec, pdb_api_version),
        statefulset(owner, spec, replicas),
    ]
    return out
