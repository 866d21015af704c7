"""Pure builders for `spec.routing`: the router Deployment (`kvship router`: Envoy and the
endpoint picker, or the picker alone), its Service, the headless Service through which it finds
the ready replicas (their EndpointSlices, read with the router's own ServiceAccount and Role),
and the Gateway API Inference Extension InferencePool (mode gateway).

The main Service and PodDisruptionBudget stay in ``builders``; ``children`` is every child the
reconciler applies, engine and router together.
"""
from __future__ import annotations

from typing import Any

from . import builders as b
from . import spec as s

ROUTER_PORT = 8000  # Envoy's listener (mode envoy)
PICKER_PORT = 9002  # the picker's gRPC ext_proc, as GIE's endpoint picker
METRICS_PORT = 9090  # the picker's /health and /metrics
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"


def routed(spec: s.LLMDeploymentSpec) -> bool:
    return spec.routing.mode != "service"


def router_name(owner: b.Owner) -> str:
    return f"{owner.name}-router"


def serving_name(owner: b.Owner) -> str:
    """The headless Service of the ready serving pods (no not-ready addresses)."""
    return f"{owner.name}-serving"


def router_labels(owner: b.Owner) -> dict[str, str]:
    return {
        **b.router_selector_labels(owner),
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/part-of": "kvship",
        "app.kubernetes.io/managed-by": b.MANAGED_BY,
    }


def router_selector_string(owner: b.Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(b.router_selector_labels(owner).items()))


def _meta(owner: b.Owner, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": router_labels(owner),
            "ownerReferences": [owner.reference()]}


def router_args(owner: b.Owner, spec: s.LLMDeploymentSpec) -> list[str]:
    r = spec.routing
    # the serving Service's EndpointSlices through the API server: works without cluster DNS
    replicas = f"{owner.namespace}/{serving_name(owner)}:http"
    args = [
        "router", "--discover-k8s", replicas,
        "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
        # on the pod's address: a gateway's ext_proc calls it (gateway), the operator and Prometheus scrape it
        "--picker-host", "0.0.0.0", "--picker-port", str(PICKER_PORT), "--metrics-port", str(METRICS_PORT),
        "--policy", r.policy, "--load-epsilon", f"{r.load_bound_percent / 100:g}",
        "--prefix-block-chars", str(r.prefix_block_chars),
    ]
    if b.kv_events(spec):
        args += ["--kv-events-port", str(b.KV_EVENTS_PORT)]
    if spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0:
        # scale from zero: a request waits for the replica it brings up (the ext_proc stream stays open)
        args += ["--hold-timeout", str(r.hold_seconds), "--hold-max-pending", str(r.hold_max_pending)]
    if r.mode == "gateway":
        args.append("--picker-only")
    if not r.endpoint_header:
        args.append("--no-endpoint-header")
    return args


def router_container(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    r = spec.routing
    ports = [{"name": "grpc", "containerPort": PICKER_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    if r.mode == "envoy":
        ports.insert(0, {"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"})
    # Not /health: it fails while no replica is ready, and a router held out of its Service then
    # could not hold the requests that bring the first replica up (scale from zero).
    ready_port = "http" if r.mode == "envoy" else "grpc"
    requests = {"cpu": "250m", "memory": "256Mi", **r.resources.requests}
    container: dict[str, Any] = {
        "name": "router",
        "image": r.image or spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["kvship"],
        "args": router_args(owner, spec),
        "ports": ports,
        "env": [{"name": "HOME", "value": "/tmp"}],  # the root filesystem is read-only; Envoy's bootstrap goes to /tmp
        "readinessProbe": {"tcpSocket": {"port": ready_port}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": "metrics"}, "periodSeconds": 15, "timeoutSeconds": 5,
                          "failureThreshold": 4},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "resources": {"requests": requests, **({"limits": dict(r.resources.limits)} if r.resources.limits else {})},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    return container


def router_deployment(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(owner),
        "securityContext": {"runAsNonRoot": True, "runAsUser": b.UID, "runAsGroup": b.UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [router_container(owner, spec)],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": ref.name} for ref in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, router_name(owner)),
        "spec": {
            "replicas": spec.routing.replicas,
            "selector": {"matchLabels": b.router_selector_labels(owner)},
            "template": {"metadata": {"labels": router_labels(owner)}, "spec": pod_spec},
        },
    }


def router_service_account(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner, router_name(owner))}


def router_role(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    """Read-only, this namespace's EndpointSlices: all `--discover-k8s` needs."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(owner, router_name(owner)),
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                   "verbs": ["get", "list", "watch"]}],
    }


def router_role_binding(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(owner, router_name(owner)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router_name(owner)},
        "subjects": [{"kind": "ServiceAccount", "name": router_name(owner), "namespace": owner.namespace}],
    }


def router_service(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    """The picker's gRPC and metrics ports (a gateway's ext_proc target); the main Service
    carries the OpenAI traffic in mode envoy."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, router_name(owner)),
        "spec": {
            "selector": b.router_selector_labels(owner),
            "ports": [
                {"name": "grpc", "port": PICKER_PORT, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "kubernetes.io/h2c"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def serving_service(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    """Headless, ready pods only: its DNS name resolves to the replicas the router may pick."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, serving_name(owner)),
        "spec": {
            "clusterIP": "None",
            "selector": b.traffic_labels(owner, spec),
            "ports": [{"name": "http", "port": s.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def inference_pool(owner: b.Owner, spec: s.LLMDeploymentSpec) -> dict[str, Any]:
    """The GIE InferencePool of the serving pods, whose endpoint picker is kvship's (mode gateway):
    an HTTPRoute's backendRef names it."""
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": _meta(owner, owner.name),
        "spec": {
            "selector": {"matchLabels": b.traffic_labels(owner, spec)},
            "targetPorts": [{"number": s.ENGINE_PORT}],
            "endpointPickerRef": {"kind": "Service", "name": router_name(owner), "port": {"number": PICKER_PORT},
                                  "failureMode": "FailClose"},
        },
    }


def router_children(owner: b.Owner, spec: s.LLMDeploymentSpec) -> list[dict[str, Any]]:
    """What routing adds (the InferencePool apart: it exists only where its CRD does)."""
    if not routed(spec):
        return []
    return [serving_service(owner, spec), router_service(owner, spec), router_service_account(owner, spec),
            router_role(owner, spec), router_role_binding(owner, spec), router_deployment(owner, spec)]


def children(owner: b.Owner, spec: s.LLMDeploymentSpec, *, pdb_api_version: str = "policy/v1",
             replicas: int | None = None) -> list[dict[str, Any]]:
    """Every child the reconciler applies, in apply order."""
    return b.build(owner, spec, pdb_api_version=pdb_api_version, replicas=replicas) + router_children(owner, spec)


# Children of a mode no longer asked for are deleted (only those this LLMDeployment owns).
ROUTER_KINDS = (("v1", "Service", serving_name), ("v1", "Service", router_name), ("apps/v1", "Deployment", router_name),
                ("rbac.authorization.k8s.io/v1", "RoleBinding", router_name),
                ("rbac.authorization.k8s.io/v1", "Role", router_name), ("v1", "ServiceAccount", router_name))
