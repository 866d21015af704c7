"""spec.routing (issue 51): the router's children as the operator builds them, valid against
Kubernetes' own schemas, and the status that reports the router."""
from __future__ import annotations

import json

import kubernetes_validate
import pytest

from kvship_operator import builders as b
from kvship_operator import router_builders as rb
from kvship_operator import spec as s
from kvship_operator import status as st
from kvship_operator.schema import parse

OWNER = b.Owner("qwen", "team-a", "uid-123")


def build(**spec):
    spec.setdefault("model", {"hub": "Qwen/Qwen3-0.6B"})
    parsed = parse(s.LLMDeploymentSpec, spec)
    return parsed, {(o["kind"], o["metadata"]["name"]): o for o in rb.children(OWNER, parsed)}


def test_kv_events_config_is_what_the_engine_takes():
    from kvship.config import KVEventsConfig

    config = KVEventsConfig.from_json(b.kv_events_config())  # what `kvship serve` does with it
    assert config.publishing and config.endpoint == f"tcp://*:{b.KV_EVENTS_PORT}"
    _, objs = build(routing={"mode": "envoy", "kvEvents": False})
    engine = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-config" not in engine["args"]
    assert "--kv-events-port" not in objs[("Deployment", "qwen-router")]["spec"]["template"]["spec"]["containers"][0][
        "args"]


def test_service_mode_builds_no_router():
    parsed, objs = build()
    assert parsed.routing.mode == "service"
    assert ("Deployment", "qwen-router") not in objs and ("Service", "qwen-serving") not in objs
    assert objs[("Service", "qwen")]["spec"]["selector"] == b.selector_labels(OWNER)


def test_envoy_mode_puts_the_router_behind_the_service():
    _, objs = build(routing={"mode": "envoy", "replicas": 2, "policy": "least-load", "loadBoundPercent": 50,
                             "endpointHeader": False}, replicas=3)
    dep = objs[("Deployment", "qwen-router")]
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "kvship-router"
    (c,) = pod["spec"]["containers"]
    assert c["image"] == s.DEFAULT_ENGINE_IMAGE and c["command"] == ["kvship"]
    args = c["args"]
    # the serving Service's EndpointSlices, read with the router's own ServiceAccount (no cluster DNS needed)
    assert args[:3] == ["router", "--discover-k8s", "team-a/qwen-serving:http"]
    assert pod["spec"]["serviceAccountName"] == "qwen-router"
    role, binding = objs[("Role", "qwen-router")], objs[("RoleBinding", "qwen-router")]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == "qwen-router" and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "qwen-router", "namespace": "team-a"}]
    assert ("ServiceAccount", "qwen-router") in objs
    assert args[args.index("--policy") + 1] == "least-load" and args[args.index("--load-epsilon") + 1] == "0.5"
    assert "--no-endpoint-header" in args and "--picker-only" not in args and "--hold-timeout" not in args
    assert {p["name"] for p in c["ports"]} == {"http", "grpc", "metrics"}
    # the engines publish their KV-cache events; the router subscribes to each one it discovers
    assert args[args.index("--kv-events-port") + 1] == str(b.KV_EVENTS_PORT)
    engine = objs[("StatefulSet", "qwen")]["spec"]["template"]["spec"]["containers"][0]
    config = json.loads(engine["args"][engine["args"].index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{b.KV_EVENTS_PORT}"}
    assert {"name": "kv-events", "containerPort": b.KV_EVENTS_PORT, "protocol": "TCP"} in engine["ports"]
    assert c["readinessProbe"] == {"tcpSocket": {"port": "http"}, "periodSeconds": 5, "timeoutSeconds": 3}
    # the OpenAI Service selects the router's pods; the engines' selectors never match them
    main = objs[("Service", "qwen")]
    assert main["spec"]["selector"] == b.router_selector_labels(OWNER)
    assert main["spec"]["ports"][0]["targetPort"] == "http"
    engine_selector = objs[("StatefulSet", "qwen")]["spec"]["selector"]["matchLabels"]
    assert not set(engine_selector.items()) <= set(pod["metadata"]["labels"].items())
    # the router finds the ready replicas through a headless Service without not-ready addresses
    serving = objs[("Service", "qwen-serving")]
    assert serving["spec"]["clusterIP"] == "None" and not serving["spec"].get("publishNotReadyAddresses")
    assert serving["spec"]["selector"] == b.traffic_labels(OWNER, parse(s.LLMDeploymentSpec, {"model": {"hub": "a"}}))
    for o in objs.values():
        assert o["metadata"]["ownerReferences"][0]["uid"] == "uid-123"


def test_scale_from_zero_makes_the_router_hold_requests():
    _, objs = build(routing={"mode": "envoy", "holdSeconds": 90}, replicas=0,
                    autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 2})
    args = objs[("Deployment", "qwen-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--hold-timeout") + 1] == "90" and args[args.index("--hold-max-pending") + 1] == "256"
    assert objs[("StatefulSet", "qwen")]["spec"]["replicas"] == 0


def test_gateway_mode_runs_the_picker_alone_for_an_inference_pool():
    parsed, objs = build(routing={"mode": "gateway"}, nodesPerReplica=2, tensorParallelSize=2)
    (c,) = objs[("Deployment", "qwen-router")]["spec"]["template"]["spec"]["containers"]
    assert "--picker-only" in c["args"] and {p["name"] for p in c["ports"]} == {"grpc", "metrics"}
    assert objs[("Service", "qwen")]["spec"]["selector"] == b.traffic_labels(OWNER, parsed)  # direct, as before
    pool = rb.inference_pool(OWNER, parsed)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"][b.ROLE_LABEL] == "leader"  # multi-node: leaders serve
    assert pool["spec"]["targetPorts"] == [{"number": s.ENGINE_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == "qwen-router" and ref["port"] == {"number": rb.PICKER_PORT}
    svc = objs[("Service", "qwen-router")]
    assert {p["port"] for p in svc["spec"]["ports"]} == {rb.PICKER_PORT, rb.METRICS_PORT}


@pytest.mark.parametrize("mode", ["envoy", "gateway"])
def test_router_children_validate_against_kubernetes_schemas(mode):
    version = kubernetes_validate.latest_version()
    _, objs = build(routing={"mode": mode, "image": "kvship/engine:0.1.0-cpu",
                             "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}}},
                    imagePullSecrets=[{"name": "regcred"}])
    for key, obj in objs.items():
        if key[0] in ("Deployment", "Service"):
            kubernetes_validate.validate(obj, version, strict=True)
    c = objs[("Deployment", "qwen-router")]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "kvship/engine:0.1.0-cpu"
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def _status(spec, router):
    parsed = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, **spec})
    ready_pod = {"metadata": {"name": "qwen-0", "labels": {"controller-revision-hash": "r1"}},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    sts = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "updateRevision": "r1"}}
    return st.compute(OWNER, parsed, sts=sts, pods=[ready_pod], previous=None, observed_generation=1,
                      now="2026-01-01T00:00:00Z", router=router)


def test_status_reports_the_router():
    plain = _status({}, None)
    assert plain["router"] is None and not st.get_condition(plain, st.ROUTER_READY)
    assert st.get_condition(plain, st.READY)["status"] == "True"

    starting = _status({"routing": {"mode": "envoy"}}, {"status": {}})
    assert starting["router"]["readyReplicas"] == 0
    assert st.get_condition(starting, st.ROUTER_READY)["reason"] == "Starting"
    # mode envoy: the Service sends every request through the router, so the endpoint waits for it
    assert st.get_condition(starting, st.READY)["reason"] == "RouterNotReady"

    ready = _status({"routing": {"mode": "envoy"}}, {"status": {"readyReplicas": 1}})
    assert st.get_condition(ready, st.ROUTER_READY)["status"] == "True"
    assert st.get_condition(ready, st.READY)["status"] == "True"
    assert ready["router"]["picker"] == f"qwen-router.team-a.svc:{rb.PICKER_PORT}"

    gateway = _status({"routing": {"mode": "gateway"}}, None)  # the replicas still serve through the Service
    assert st.get_condition(gateway, st.ROUTER_READY)["reason"] == "NotCreated"
    assert st.get_condition(gateway, st.READY)["status"] == "True"
