"""The `LLMDeployment` API (kvship.io/v1alpha1), defined once.

The CRD YAML (``python -m kvship_operator.crd``) and the operator's parsing both come from
these dataclasses; cross-field rules are written as CEL for the API server and as Python for
the operator (which also guards clusters too old for CEL).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .schema import Quantity, RawObject, Rule, SpecError, field

GROUP = "kvship.io"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ["llmd"]
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_ENGINE_IMAGE = "kvship/engine:0.1.0"
ENGINE_PORT = 8000
OPERATOR_OWNED_ARGS = ("--host", "--port", "--tensor-parallel-size", "--served-model-name", "--shutdown-timeout")

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

# The LLMDeployment's own name: every child name derives from it, and the tightest are DNS-1035
# labels (Services: a letter first, no dots, at most 63 characters) and the label values the
# StatefulSet controller derives from its StatefulSet (`controller-revision-hash`:
# "<statefulset>-<hash of up to 10>", pod names "<statefulset>-<ordinal>"), for StatefulSets
# named "<name>" and, for multi-node groups, "<name>-<group>-workers". 42 leaves every one of
# them valid (tests/operator/test_operator_builders.py checks them all at this length).
RESOURCE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 42
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


def check_name(name: str) -> None:
    """The rule the CRD's metadata schema states, for names stored before it existed."""
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError("metadata.name", f"may not be longer than {MAX_NAME_LENGTH} (child names derive from it)")
    if not re.match(RESOURCE_NAME_PATTERN, name):
        raise SpecError("metadata.name", f"should match '{RESOURCE_NAME_PATTERN}' (a DNS-1035 label: "
                        "lower-case letters, digits and '-', starting with a letter; no dots)")


@dataclass
class SecretKeyRef:
    """A key of a Secret in the LLMDeployment's namespace."""

    name: str = field(description="Secret name.", pattern=NAME_PATTERN, max_length=253)
    key: str = field("HF_TOKEN", description="Key inside the Secret.", max_length=253)


@dataclass
class PvcSource:
    """Model files already on a PersistentVolumeClaim."""

    claim_name: str = field(description="Name of an existing PVC holding the model.", pattern=NAME_PATTERN, max_length=253)
    path: Optional[str] = field(None, description="Folder of the model inside the claim (default: its root).", max_length=1024)


@dataclass
class ModelSource:
    """Where the weights come from: exactly one of hub, url or pvc."""

    __one_of__ = ("hub", "url", "pvc")
    __rules__ = [
        Rule(
            cel="[has(self.hub), has(self.url), has(self.pvc)].filter(x, x).size() == 1",
            message="exactly one of hub, url, pvc must be set",
            check=lambda m: sum(x is not None for x in (m.hub, m.url, m.pvc)) == 1,
        ),
        Rule(
            cel="!has(self.revision) || has(self.hub)",
            message="revision applies only to a hub model",
            check=lambda m: m.revision is None or m.hub is not None,
        ),
        Rule(
            cel="!has(self.tokenSecret) || !has(self.pvc)",
            message="tokenSecret applies to hub and url models, not to pvc",
            check=lambda m: m.token_secret is None or m.pvc is None,
        ),
    ]

    hub: Optional[str] = field(
        None,
        description="Model id on a model hub (e.g. Qwen/Qwen3-0.6B); downloaded into the model cache.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$",
        max_length=256,
    )
    revision: Optional[str] = field(None, description="Hub revision (branch, tag or commit).", max_length=256)
    url: Optional[str] = field(
        None,
        description="http(s) URL of a model file or .tar/.tar.gz/.zip archive; downloaded into the model cache.",
        pattern=r"^https?://",
        max_length=2048,
    )
    pvc: Optional[PvcSource] = field(None, description="Model already on a PVC (mounted read-only).")
    token_secret: Optional[SecretKeyRef] = field(
        None, description="Secret key holding the hub token (HF_TOKEN) or a bearer token for the URL."
    )
    size_hint: Optional[Quantity] = field(
        None,
        description="Approximate size of the weights (e.g. 16Gi for an 8B model in bf16): sizes the default memory "
        "request (weights + 25% + 4Gi). Without it: 16Gi per GPU, 8Gi on CPU.",
    )


@dataclass
class EnvVar:
    """An environment variable of the engine container."""

    __rules__ = [
        Rule(
            cel="!(has(self.value) && has(self.valueFrom))",
            message="set value or valueFrom, not both",
            check=lambda e: not (e.value is not None and e.value_from is not None),
        )
    ]

    name: str = field(description="Variable name.", pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=253)
    value: Optional[str] = field(None, description="Literal value.")
    value_from: Optional[RawObject] = field(None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, ...).")


@dataclass
class Engine:
    """The engine container."""

    __rules__ = [
        Rule(
            # a first line of defence on servers with CEL; the operator checks every spelling and
            # abbreviation with the engine's own parser (engine_args.py)
            cel="self.args.all(a, !a.startsWith('--host') && !a.startsWith('--port') && "
            "!a.startsWith('--tensor-parallel-size') && !a.startsWith('-tp') && "
            "!a.startsWith('--served-model-name') && !a.startsWith('--shutdown-timeout'))",
            message="engine.args may not set --host, --port, --tensor-parallel-size (-tp), --served-model-name or "
            "--shutdown-timeout (the operator sets them from the spec)",
            check=lambda e: not any(a.startswith((*OPERATOR_OWNED_ARGS, "-tp")) for a in e.args),
        )
    ]

    image: str = field(DEFAULT_ENGINE_IMAGE, description="Engine image.", min_length=1, max_length=512)
    image_pull_policy: str = field(
        "IfNotPresent", description="Image pull policy.", enum=["Always", "IfNotPresent", "Never"]
    )
    args: list[str] = field([], description="Extra `kvship serve` arguments.", max_items=64, max_length=1024)
    env: list[EnvVar] = field([], description="Extra environment variables.", max_items=64)


@dataclass
class Gpu:
    """Accelerators per replica."""

    resource_name: str = field(
        "nvidia.com/gpu", description="Extended resource name of the accelerator.", pattern=LABEL_KEY_PATTERN, max_length=253
    )
    count: Optional[int] = field(
        None,
        description="Accelerators per replica; defaults to tensorParallelSize. 0 runs on CPU.",
        minimum=0,
        maximum=16,
    )


@dataclass
class Resources:
    """Extra CPU/memory requests and limits of the engine container (GPUs come from `gpu`)."""

    requests: dict[str, Quantity] = field({}, description="Resource requests.")
    limits: dict[str, Quantity] = field({}, description="Resource limits.")


@dataclass
class Autoscaling:
    """Replica autoscaling on queue depth (waiting + running requests per ready replica).
    `provider` picks the built-in autoscaler or an emitted HPA / KEDA ScaledObject; all of
    them act through the `scale` subresource (`spec.replicas`)."""

    __rules__ = [
        Rule(
            cel="self.minReplicas <= self.maxReplicas",
            message="autoscaling.minReplicas must be <= autoscaling.maxReplicas",
            check=lambda a: a.min_replicas <= a.max_replicas,
        ),
        Rule(
            cel="self.provider != 'keda' || has(self.prometheusServerAddress)",
            message="autoscaling.provider keda needs autoscaling.prometheusServerAddress",
            check=lambda a: a.provider != "keda" or a.prometheus_server_address is not None,
        ),
    ]

    enabled: bool = field(False, description="Scale replicas between minReplicas and maxReplicas.")
    provider: str = field("builtin", description="Who scales.", enum=["builtin", "hpa", "keda"])
    min_replicas: int = field(1, description="Lower bound.", minimum=0, maximum=100)
    max_replicas: int = field(1, description="Upper bound.", minimum=1, maximum=100)
    target_requests_per_replica: int = field(
        8, description="Target waiting + running requests per ready replica.", minimum=1, maximum=10000
    )
    scale_up_stabilization_seconds: int = field(
        0, description="Window over which the highest recommendation is used before scaling up.", minimum=0, maximum=3600
    )
    scale_down_stabilization_seconds: int = field(
        300, description="Window over which the highest recommendation is used before scaling down.", minimum=0, maximum=86400
    )
    interval_seconds: int = field(15, description="Metrics polling period (built-in provider).", minimum=1, maximum=600)
    prometheus_server_address: Optional[str] = field(
        None, description="Prometheus URL queried by a KEDA ScaledObject.", pattern=r"^https?://", max_length=2048
    )
    idle_seconds: int = field(
        600,
        description="With minReplicas 0: how long no request may run, wait or be held by the router before the "
        "last replica is removed.",
        minimum=30,
        maximum=86400,
    )


# ---------------------------------------------------------------------------------------
# Scheduling: core/v1 Toleration and Affinity with their real schemas (a typo such as `efect`
# is refused by kubectl's validation and by servers doing strict field validation; a wrong
# enum value by every server). Every field is optional without a default, so that what is
# built is exactly what the user wrote.


@dataclass
class Toleration:
    """A core/v1 Toleration."""

    key: Optional[str] = field(
        None, description="Taint key to tolerate (empty with Exists: every taint).", max_length=316
    )
    operator: Optional[str] = field(None, description="Equal (default) or Exists.", enum=["Exists", "Equal"])
    value: Optional[str] = field(None, description="Taint value to match (Equal).", max_length=63)
    effect: Optional[str] = field(
        None, description="Taint effect to match (empty: all).", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]
    )
    toleration_seconds: Optional[int] = field(None, description="How long a NoExecute taint is tolerated.")


@dataclass
class NodeSelectorRequirement:
    """A core/v1 NodeSelectorRequirement."""

    key: str = field(description="Node label key (or field, in matchFields).", max_length=316)
    operator: str = field(
        description="How the values apply.", enum=["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    )
    values: Optional[list[str]] = field(None, description="Values (In/NotIn: one or more; Gt/Lt: one integer).")


@dataclass
class NodeSelectorTerm:
    """A core/v1 NodeSelectorTerm (requirements ANDed)."""

    match_expressions: Optional[list[NodeSelectorRequirement]] = field(None, description="Requirements on node labels.")
    match_fields: Optional[list[NodeSelectorRequirement]] = field(None, description="Requirements on node fields.")


@dataclass
class NodeSelector:
    """A core/v1 NodeSelector (terms ORed)."""

    node_selector_terms: list[NodeSelectorTerm] = field(description="Terms, any of which may match.")


@dataclass
class PreferredSchedulingTerm:
    """A core/v1 PreferredSchedulingTerm."""

    weight: int = field(description="Weight (1-100).", minimum=1, maximum=100)
    preference: NodeSelectorTerm = field(description="The preferred nodes.")


@dataclass
class NodeAffinity:
    """A core/v1 NodeAffinity."""

    required_during_scheduling_ignored_during_execution: Optional[NodeSelector] = field(
        None, description="Nodes the pods must run on."
    )
    preferred_during_scheduling_ignored_during_execution: Optional[list[PreferredSchedulingTerm]] = field(
        None, description="Nodes the pods should run on."
    )


@dataclass
class LabelSelectorRequirement:
    """A metav1 LabelSelectorRequirement."""

    key: str = field(description="Label key.", max_length=316)
    operator: str = field(description="How the values apply.", enum=["In", "NotIn", "Exists", "DoesNotExist"])
    values: Optional[list[str]] = field(None, description="Values (In/NotIn).")


@dataclass
class LabelSelector:
    """A metav1 LabelSelector."""

    match_labels: Optional[dict[str, str]] = field(None, description="Labels that must all match.")
    match_expressions: Optional[list[LabelSelectorRequirement]] = field(None, description="Requirements, ANDed.")


@dataclass
class PodAffinityTerm:
    """A core/v1 PodAffinityTerm."""

    topology_key: str = field(description="Node label whose value defines co-location (e.g. kubernetes.io/hostname).",
                              min_length=1, max_length=316)
    label_selector: Optional[LabelSelector] = field(None, description="The pods this term is about.")
    namespaces: Optional[list[str]] = field(None, description="Namespaces of those pods (default: this one).")
    namespace_selector: Optional[LabelSelector] = field(None, description="Namespaces of those pods, by label.")


@dataclass
class WeightedPodAffinityTerm:
    """A core/v1 WeightedPodAffinityTerm."""

    weight: int = field(description="Weight (1-100).", minimum=1, maximum=100)
    pod_affinity_term: PodAffinityTerm = field(description="The term.")


@dataclass
class PodAffinity:
    """A core/v1 PodAffinity or PodAntiAffinity."""

    required_during_scheduling_ignored_during_execution: Optional[list[PodAffinityTerm]] = field(
        None, description="Terms that must hold."
    )
    preferred_during_scheduling_ignored_during_execution: Optional[list[WeightedPodAffinityTerm]] = field(
        None, description="Terms that should hold."
    )


@dataclass
class Affinity:
    """A core/v1 Affinity."""

    node_affinity: Optional[NodeAffinity] = field(None, description="Node affinity.")
    pod_affinity: Optional[PodAffinity] = field(None, description="Pod affinity.")
    pod_anti_affinity: Optional[PodAffinity] = field(None, description="Pod anti-affinity.")


@dataclass
class ModelCache:
    """Where downloaded models are kept. mode PerReplica (the default): a claim per replica
    (volumeClaimTemplates), which any ReadWriteOnce storage provides and no two replicas
    write at once; Shared: one claim mounted by every replica (ReadWriteMany, so replicas on
    several nodes can mount it), downloads serialised by a lock in the cache. Created claims
    belong to the LLMDeployment and go away with it; an existing claim is only mounted."""

    __rules__ = [
        Rule(
            cel="!has(self.existingClaim) || !has(self.storageClassName)",
            message="modelCache.storageClassName applies only to a claim the operator creates (not with existingClaim)",
            check=lambda c: c.existing_claim is None or c.storage_class_name is None,
        ),
        Rule(
            cel="!has(self.existingClaim) || !has(self.mode) || self.mode == 'Shared'",
            message="modelCache.existingClaim is one claim shared by every replica: mode must be Shared",
            check=lambda c: c.existing_claim is None or c.mode in (None, "Shared"),
        ),
        Rule(
            cel="!has(self.mode) || self.mode != 'Shared' || has(self.existingClaim) || !has(self.accessMode) "
            "|| self.accessMode == 'ReadWriteMany'",
            message="a Shared model cache is mounted by replicas on several nodes: accessMode must be ReadWriteMany "
            "(or use mode PerReplica)",
            check=lambda c: c.mode != "Shared" or c.existing_claim is not None
            or c.access_mode in (None, "ReadWriteMany"),
        ),
    ]

    mode: Optional[str] = field(
        None,
        description="PerReplica (default): a claim per replica; Shared: one ReadWriteMany claim for all "
        "(the default with existingClaim).",
        enum=["PerReplica", "Shared"],
    )

    enabled: bool = field(True, description="Keep models on a PVC; false uses an emptyDir per pod.")
    existing_claim: Optional[str] = field(
        None, description="Use this existing PVC instead of creating one.", pattern=NAME_PATTERN, max_length=253
    )
    size: Quantity = field(Quantity("50Gi"), description="Size of the created PVC.")
    storage_class_name: Optional[str] = field(None, description="StorageClass of the created PVC.", max_length=253)
    access_mode: Optional[str] = field(
        None,
        description="Access mode of the created claims (default: ReadWriteOnce per replica, ReadWriteMany shared).",
        enum=["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"],
    )

    @property
    def shared(self) -> bool:
        return self.mode == "Shared" or (self.mode is None and self.existing_claim is not None)

    @property
    def effective_access_mode(self) -> str:
        return self.access_mode or ("ReadWriteMany" if self.shared else "ReadWriteOnce")


@dataclass
class ServiceSpec:
    """The Service in front of the replicas (the OpenAI endpoint)."""

    type: str = field("ClusterIP", description="Service type.", enum=["ClusterIP", "NodePort", "LoadBalancer"])
    port: int = field(8000, description="Service port.", minimum=1, maximum=65535)
    annotations: dict[str, str] = field({}, description="Service annotations.")


ROUTING_MODES = ["service", "envoy", "gateway"]
ROUTING_POLICIES = ["prefix", "least-load", "round-robin"]


@dataclass
class Routing:
    """How requests reach the replicas. service: the Service selects the replicas (connections
    spread by Kubernetes); envoy: a router Deployment (`kvship router`: Envoy and kvship's endpoint
    picker) behind the Service picks a replica per request; gateway: the endpoint picker alone,
    named by a Gateway API Inference Extension InferencePool for a gateway the cluster runs."""

    mode: str = field("service", description="service, envoy or gateway.", enum=ROUTING_MODES)
    replicas: int = field(1, description="Router pods.", minimum=1, maximum=20)
    policy: str = field(
        "prefix",
        description="prefix: the replica holding the prompt's leading blocks, within a load bound; "
        "least-load; round-robin.",
        enum=ROUTING_POLICIES,
    )
    load_bound_percent: int = field(
        25,
        description="prefix policy: a replica takes a request while its load stays within (100 + this)% of the "
        "mean (the picker's --load-epsilon).",
        minimum=0,
        maximum=1000,
    )
    prefix_block_chars: int = field(
        64, description="Characters of the rendered prompt in one prefix block.", minimum=1, maximum=65536
    )
    endpoint_header: bool = field(True, description="Add the response header x-kvship-endpoint (mode envoy).")
    kv_events: bool = field(
        True,
        description="The engines publish their KV-cache events (vLLM's format, ZMQ on port 5557) and the router "
        "scores the prefix policy by the blocks each engine reports holding (envoy, gateway).",
    )
    hold_seconds: int = field(
        300,
        description="With autoscaling.minReplicas 0: how long the router holds a request while no replica is ready "
        "(one is starting) before answering 503 with Retry-After.",
        minimum=1,
        maximum=3600,
    )
    hold_max_pending: int = field(
        256, description="Most requests held at once; more get 503 at once.", minimum=1, maximum=100000
    )
    image: Optional[str] = field(
        None, description="Router image (default: engine.image, which ships `kvship router`).", min_length=1,
        max_length=512,
    )
    resources: Resources = field({}, description="CPU and memory of the router container.")


@dataclass
class AdapterSource:
    """Where a LoRA adapter (PEFT folder) comes from: exactly one of hub, url or pvc."""

    __rules__ = [
        Rule(
            cel="[has(self.hub), has(self.url), has(self.pvc)].filter(x, x).size() == 1",
            message="exactly one of hub, url, pvc must be set",
            check=lambda a: sum(x is not None for x in (a.hub, a.url, a.pvc)) == 1,
        ),
        Rule(
            cel="!has(self.pvc) || !has(self.pvc.path) || !self.pvc.path.matches('(^|/)[.][.](/|$)')",
            message="pvc.path may not contain '..' (it is a folder inside the claim)",
            check=lambda a: a.pvc is None or ".." not in (a.pvc.path or "").split("/"),
        ),
    ]

    hub: Optional[str] = field(
        None, description="Adapter id on a model hub; the engine downloads it.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$", max_length=256,
    )
    url: Optional[str] = field(
        None, description="http(s) URL of the adapter's folder (its two files are fetched from below it).",
        pattern=r"^https?://", max_length=2048,
    )
    pvc: Optional[PvcSource] = field(None, description="Adapter folder on a PVC (mounted read-only).")


@dataclass
class Adapter:
    """A LoRA adapter served on the base model: clients send its name as `model`."""

    name: str = field(description="Adapter name (the OpenAI `model` that selects it).",
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$", max_length=253)
    source: AdapterSource = field(description="Where the adapter comes from.")


def duplicate_adapter_names(adapters: list[Adapter]) -> list[str]:
    names = [a.name for a in adapters]
    return sorted({n for n in names if names.count(n) > 1})


@dataclass
class LocalObjectReference:
    """A reference to an object in the same namespace."""

    name: str = field(description="Object name.", pattern=NAME_PATTERN, max_length=253)


@dataclass
class LLMDeploymentSpec:
    """Desired state of an LLM served by kvship engine replicas."""

    __rules__ = [
        Rule(
            cel="self.tensorParallelSize in [1, 2, 4, 8]",
            message="tensorParallelSize must be 1, 2, 4 or 8",
            check=lambda s: s.tensor_parallel_size in (1, 2, 4, 8),
        ),
        Rule(
            cel="!has(self.gpu.count) || self.gpu.count == 0 || self.gpu.count >= self.tensorParallelSize",
            message="gpu.count must be 0 (CPU) or at least tensorParallelSize",
            check=lambda s: s.gpu.count is None or s.gpu.count == 0 or s.gpu.count >= s.tensor_parallel_size,
        ),
        Rule(
            cel="!has(self.gpu.count) || self.gpu.count != 0 || self.tensorParallelSize == 1",
            message="tensorParallelSize > 1 needs GPUs (gpu.count 0 means CPU)",
            check=lambda s: s.gpu.count is None or s.gpu.count != 0 or s.tensor_parallel_size == 1,
        ),
        Rule(
            cel="self.tensorParallelSize % self.nodesPerReplica == 0",
            message="tensorParallelSize must be a multiple of nodesPerReplica (each pod of a group runs "
            "tensorParallelSize / nodesPerReplica ranks)",
            check=lambda s: s.tensor_parallel_size % s.nodes_per_replica == 0,
        ),
        Rule(
            cel="!has(self.gpu.count) || self.gpu.count % self.nodesPerReplica == 0",
            message="gpu.count (per replica) must be a multiple of nodesPerReplica",
            check=lambda s: s.gpu.count is None or s.gpu.count % s.nodes_per_replica == 0,
        ),
        Rule(
            cel="!self.autoscaling.enabled || self.autoscaling.minReplicas > 0 || self.routing.mode != 'service'",
            message="autoscaling.minReplicas 0 (scale from zero) needs routing.mode envoy or gateway: the router "
            "holds requests while no replica runs and tells the operator about them",
            check=lambda s: not s.autoscaling.enabled or s.autoscaling.min_replicas > 0
            or s.routing.mode != "service",
        ),
        Rule(
            cel="!self.autoscaling.enabled || self.autoscaling.minReplicas > 0 || self.autoscaling.provider != 'hpa'",
            message="autoscaling.provider hpa cannot scale to zero (an HPA's minReplicas is at least 1): use "
            "provider builtin or keda with minReplicas 0",
            check=lambda s: not s.autoscaling.enabled or s.autoscaling.min_replicas > 0
            or s.autoscaling.provider != "hpa",
        ),
        Rule(
            cel="!self.autoscaling.enabled || (self.replicas >= self.autoscaling.minReplicas && "
            "self.replicas <= self.autoscaling.maxReplicas)",
            message="replicas must lie within autoscaling.minReplicas..maxReplicas when autoscaling is enabled",
            check=lambda s: not s.autoscaling.enabled
            or s.autoscaling.min_replicas <= s.replicas <= s.autoscaling.max_replicas,
        ),
        Rule(
            cel="self.adapters.all(a, self.adapters.exists_one(b, b.name == a.name))",
            message="adapters: names must be unique",
            check=lambda s: not duplicate_adapter_names(s.adapters),
        ),
    ]

    model: ModelSource = field(description="Model source.")
    adapters: list[Adapter] = field(
        [],
        description="LoRA adapters served on the model. The engine runs with --enable-lora and "
        "--allow-runtime-lora-updating, and the operator loads and unloads adapters in running replicas to match "
        "this list (no restart).",
        max_items=64,
    )
    served_model_name: Optional[str] = field(
        None,
        description="Model name clients send in the OpenAI `model` field; defaults to the hub id or the resource name.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        max_length=253,
    )
    engine: Engine = field({}, description="Engine container.")
    tensor_parallel_size: int = field(1, description="Tensor-parallel degree (GPUs per replica).", minimum=1, maximum=8)
    nodes_per_replica: int = field(
        1,
        description="Pods per replica. Above 1 a replica is a group: a leader and nodesPerReplica - 1 workers, "
        "each with tensorParallelSize / nodesPerReplica GPUs, that meet through the engine's cross-host "
        "environment, start, fail and scale as one; only the leader serves traffic.",
        minimum=1,
        maximum=8,
    )
    gpu: Gpu = field({}, description="Accelerators per replica.")
    resources: Resources = field({}, description="CPU and memory of the engine container.")
    replicas: int = field(1, description="Replicas (the scale subresource's target).", minimum=0, maximum=100)
    autoscaling: Autoscaling = field({}, description="Autoscaling on queue depth.")
    node_selector: dict[str, str] = field({}, description="Node selector of the pods.")
    tolerations: list[Toleration] = field([], description="Tolerations of the pods (core/v1 Toleration).", max_items=64)
    affinity: Optional[Affinity] = field(None, description="Affinity of the pods (core/v1 Affinity).")
    model_cache: ModelCache = field({}, description="Model cache volume.")
    service: ServiceSpec = field({}, description="The Service exposing the OpenAI API.")
    routing: Routing = field({}, description="How requests reach the replicas: the Service alone, or a router.")
    shm_size: Quantity = field(Quantity("8Gi"), description="Size of the /dev/shm memory volume (NCCL).")
    shutdown_timeout_seconds: int = field(
        30,
        description="How long a stopping replica may finish its in-flight requests (engine --shutdown-timeout); "
        "the pod's grace period is this plus the preStop wait and a margin.",
        minimum=0,
        maximum=3600,
    )
    startup_timeout_seconds: int = field(
        1800, description="How long a replica may take to load the model before it is restarted.", minimum=60, maximum=86400
    )
    download_timeout_seconds: int = field(
        3600, description="Time limit of the model download step.", minimum=60, maximum=172800
    )
    pod_annotations: dict[str, str] = field({}, description="Annotations of the pods.")
    service_account_name: Optional[str] = field(None, description="ServiceAccount of the pods.", pattern=NAME_PATTERN, max_length=253)
    image_pull_secrets: list[LocalObjectReference] = field([], description="Image pull secrets.", max_items=16)
    priority_class_name: Optional[str] = field(None, description="PriorityClass of the pods.", max_length=253)


@dataclass
class Condition:
    """A metav1.Condition."""

    type: str = field(description="Condition type (Ready, ModelCached, WorkloadReady).", max_length=316)
    status: str = field(description="True, False or Unknown.", enum=["True", "False", "Unknown"])
    reason: str = field(description="CamelCase reason.", max_length=1024)
    message: str = field(description="Human-readable details.", max_length=32768)
    last_transition_time: str = field(description="When status last changed (RFC 3339).")
    observed_generation: Optional[int] = field(None, description="Generation the condition was computed for.", minimum=0)


@dataclass
class AutoscalingStatus:
    """What the autoscaler last decided."""

    provider: Optional[str] = field(None, description="Who scales: builtin, hpa or keda.")
    desired_replicas: Optional[int] = field(None, description="Replicas the autoscaler wants now.")
    recommended_replicas: Optional[int] = field(None, description="This poll's recommendation, before stabilisation.")
    observed_load: Optional[str] = field(
        None, description="Waiting + running requests over the ready pods (moving average, decimal string)."
    )
    scraped_pods: Optional[int] = field(None, description="Ready pods whose metrics were read at the last poll.")
    reason: Optional[str] = field(
        None, description="Last decision: ScaleUp, ScaleDown, OutOfBounds, Steady, Stabilizing, PodsStarting, "
        "NoMetrics, and with minReplicas 0: ScaleFromZero, ScaleToZero, Idle."
    )
    last_scale_time: Optional[str] = field(None, description="When replicas were last changed (RFC 3339).")
    message: Optional[str] = field(None, description="Why.")


@dataclass
class RouterStatus:
    """The router (spec.routing envoy or gateway)."""

    mode: Optional[str] = field(None, description="envoy or gateway.")
    replicas: Optional[int] = field(None, description="Router pods wanted.")
    ready_replicas: Optional[int] = field(None, description="Router pods ready.")
    picker: Optional[str] = field(None, description="The endpoint picker's gRPC address (host:port).")


@dataclass
class ReplicaAdapters:
    """What one replica holds of spec.adapters."""

    replica: str = field(description="Pod name.")
    adapters: list[str] = field([], description="Adapter names it serves.")
    message: Optional[str] = field(None, description="Why it does not hold all of spec.adapters (a failed load).")


@dataclass
class LLMDeploymentStatus:
    """Observed state, written by the operator."""

    conditions: list[Condition] = field(
        [], description="Ready, ModelCached, WorkloadReady, Synced, Progressing and (with a router) RouterReady."
    )
    observed_generation: Optional[int] = field(None, description="The spec generation this status describes.")
    replicas: Optional[int] = field(None, description="Current replicas (pods created).")
    ready_replicas: Optional[int] = field(None, description="Replicas passing readiness.")
    updated_replicas: Optional[int] = field(None, description="Replicas running the current spec.")
    updated_ready_replicas: Optional[int] = field(None, description="Ready replicas running the current spec.")
    serving_model: Optional[str] = field(
        None,
        description="What the ready replicas serve, as they report it (several, comma-separated, during a rollout).",
    )
    selector: Optional[str] = field(None, description="Label selector of the pods (for the scale subresource).")
    endpoint: Optional[str] = field(None, description="In-cluster URL of the OpenAI API.")
    served_model_name: Optional[str] = field(None, description="Model name clients use.")
    autoscaling: Optional[AutoscalingStatus] = field(None, description="Autoscaler state.")
    router: Optional[RouterStatus] = field(None, description="Router state (spec.routing envoy or gateway).")
    adapters: Optional[list[ReplicaAdapters]] = field(
        None, description="The LoRA adapters each ready replica holds (spec.adapters)."
    )
