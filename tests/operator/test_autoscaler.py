"""The built-in autoscaler's pure parts: decisions over a fake clock, the metrics parser, the
HPA / ScaledObject builders and the reconcile span."""
from __future__ import annotations

import datetime as dt
import http.server
import threading

import pytest

from kvship_operator import autoscale, tracing
from kvship_operator import autoscaler as asc
from kvship_operator import builders as b
from kvship_operator import metrics_client as mc
from kvship_operator import spec as s
from kvship_operator.schema import parse

POLICY = asc.Policy(min_replicas=1, max_replicas=5, target_per_replica=4, scale_up_window=0,
                    scale_down_window=60, average_window=6)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def tick(self, dt_: float = 2.0) -> float:
        self.t += dt_
        return self.t


def run(scaler: asc.Autoscaler, clock: Clock, load: float, replicas: int, *, policy=POLICY, starting: int = 0,
        dt_: float = 2.0) -> asc.Decision:
    now = clock.tick(dt_)
    scaler.observe(now, load)
    return scaler.decide(policy, now, replicas, starting=starting)


def test_scales_up_at_once_to_ceil_of_load_over_target():
    scaler, clock = asc.Autoscaler(), Clock()
    d = run(scaler, clock, 9, 1)  # ceil(9 / 4) = 3
    assert (d.reason, d.replicas, d.recommendation) == ("ScaleUp", 3, 3) and d.changed
    d = run(scaler, clock, 9, 3)
    assert (d.reason, d.replicas) == ("Steady", 3)


def test_moving_average_smooths_a_spike():
    scaler, clock = asc.Autoscaler(), Clock()
    for _ in range(3):
        run(scaler, clock, 4, 1)
    d = run(scaler, clock, 16, 1)  # average of 4, 4, 16 over the 6 s window = 8 -> 2
    assert d.load == pytest.approx(8.0) and d.replicas == 2


def test_scale_up_window_takes_the_lowest_recommendation():
    policy = asc.Policy(1, 5, 4, scale_up_window=10, scale_down_window=60, average_window=1)
    scaler, clock = asc.Autoscaler(), Clock()
    assert run(scaler, clock, 4, 1, policy=policy).reason == "Steady"
    d = run(scaler, clock, 20, 1, policy=policy)  # 5 now, but 1 two seconds ago
    assert (d.reason, d.replicas) == ("Stabilizing", 1)
    for _ in range(4):
        d = run(scaler, clock, 20, 1, policy=policy)
    assert d.reason == "Stabilizing"
    d = run(scaler, clock, 20, 1, policy=policy)  # the low sample has left the 10 s window
    assert (d.reason, d.replicas) == ("ScaleUp", 5)


def test_scales_down_only_after_the_window_and_to_the_window_max():
    scaler, clock = asc.Autoscaler(), Clock()
    replicas = run(scaler, clock, 20, 1).replicas
    assert replicas == 5
    start = clock.t
    # load drops to 6 (-> 2) for 30 s, then to 0 (-> 1)
    changes = []
    while replicas > 1:
        d = run(scaler, clock, 6 if clock.t - start < 30 else 0, replicas)
        assert d.reason in ("Stabilizing", "ScaleDown"), d
        if d.changed:
            changes.append((clock.t - start, d.replicas))
            replicas = d.replicas
        assert clock.t - start < 300
    # nothing for a whole window after the last high recommendation
    assert changes[0][0] >= POLICY.scale_down_window
    # always down to the highest recommendation of the window: 2 while load 6 is in it, 1 only
    # a whole window after the last sample of load 6 (at +30 s, smoothed over 6 s)
    assert [r for _, r in changes] == sorted({r for _, r in changes}, reverse=True)
    assert 2 in [r for _, r in changes]
    assert changes[-1][1] == 1 and changes[-1][0] >= 30 + POLICY.scale_down_window


def test_no_flapping_under_oscillating_load():
    """Load alternating between high and low every 10 s: up once, never down."""
    scaler, clock = asc.Autoscaler(), Clock()
    policy = asc.Policy(1, 5, 4, scale_up_window=0, scale_down_window=60, average_window=2)
    replicas, changes = 1, []
    for i in range(200):
        load = 16 if (i // 5) % 2 == 0 else 0
        d = run(scaler, clock, load, replicas, policy=policy)
        if d.changed:
            changes.append((clock.t, d.reason, d.replicas))
            replicas = d.replicas
    assert [c[1:] for c in changes] == [("ScaleUp", 4)]


def test_bounds_always_hold():
    policy = asc.Policy(min_replicas=2, max_replicas=3, target_per_replica=1, scale_down_window=0, average_window=1)
    scaler, clock = asc.Autoscaler(), Clock()
    replicas = 2
    for load in [0, 100, 1000, 0, 0, 50, 0]:
        d = run(scaler, clock, load, replicas, policy=policy, dt_=5)
        assert 2 <= d.replicas <= 3 and 2 <= d.recommendation <= 3
        replicas = d.replicas
    # replicas outside the bounds (bounds edited) are corrected at once, up or down
    assert run(scaler, clock, 0, 7, policy=policy).replicas == 3
    assert run(scaler, clock, 0, 1, policy=policy).reason == "OutOfBounds"
    # minReplicas 0: the built-in autoscaler keeps one replica (no metrics without a pod)
    zero = asc.Policy(min_replicas=0, max_replicas=3, target_per_replica=1, scale_down_window=0, average_window=1)
    assert run(asc.Autoscaler(), clock, 0, 1, policy=zero).replicas == 1


def test_no_scale_down_while_a_pod_starts():
    policy = asc.Policy(1, 5, 4, scale_down_window=10, average_window=1)
    scaler, clock = asc.Autoscaler(), Clock()
    for _ in range(10):
        d = run(scaler, clock, 0, 3, policy=policy, starting=1)
    assert (d.reason, d.replicas) == ("PodsStarting", 3)
    d = run(scaler, clock, 0, 3, policy=policy, starting=0)
    assert (d.reason, d.replicas) == ("ScaleDown", 1)
    # scaling up is never held by a starting pod
    assert run(scaler, clock, 40, 1, policy=policy, starting=2).replicas == 5


def test_fresh_state_waits_a_whole_window_before_scaling_down():
    """After an operator restart nothing is known about the last window: hold."""
    scaler, clock = asc.Autoscaler(), Clock()
    d = run(scaler, clock, 0, 4)
    assert (d.reason, d.replicas) == ("Stabilizing", 4)
    for _ in range(40):
        d = run(scaler, clock, 0, 4)
        if d.changed:
            break
    assert d.reason == "ScaleDown" and scaler.first_seen is not None and clock.t - scaler.first_seen >= 60


def test_no_metrics_holds():
    scaler, clock = asc.Autoscaler(), Clock()
    now = clock.tick()
    scaler.observe(now, None)
    d = scaler.decide(POLICY, now, 3)
    assert (d.reason, d.replicas, d.load) == ("NoMetrics", 3, None)


def test_policy_from_spec():
    spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "replicas": 2, "autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetRequestsPerReplica": 3,
        "scaleDownStabilizationSeconds": 20, "intervalSeconds": 2}})
    p = asc.Policy.from_spec(spec.autoscaling)
    assert (p.min_replicas, p.max_replicas, p.target_per_replica, p.scale_up_window, p.scale_down_window,
            p.average_window) == (1, 4, 3.0, 0.0, 20.0, 6.0)


# ---------------------------------------------------------------------------------------
# metrics


METRICS = """# HELP kvship:num_requests_running Requests in the running batch.
# TYPE kvship:num_requests_running gauge
kvship:num_requests_running{model_name="m"} 2.0
# TYPE kvship:num_requests_waiting gauge
kvship:num_requests_waiting{model_name="m"} 5.0
kvship:num_requests_waiting_total 99
kvship:kv_cache_usage_perc{model_name="m"} 0.5
"""


def test_parse_load():
    assert mc.parse_load(METRICS) == 7.0
    assert mc.parse_load("kvship:num_requests_running 3\n") == 3.0
    assert mc.parse_load("other 1\n") is None


def _pod(name, ready=True, ip=None, created="2025-01-01T00:00:00Z"):
    return {"metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_scrape_ready_pods_where_the_resolver_says():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        addr = f"127.0.0.1:{server.server_address[1]}"
        where = {"p-0": addr, "p-1": "127.0.0.1:1"}.get
        got = mc.scrape([_pod("p-0"), _pod("p-1"), _pod("p-2"), _pod("p-3", ready=False)], timeout=1,
                        pod_address=lambda pod: where(pod["metadata"]["name"]))
        assert got.total == 7.0 and got.per_pod == {"p-0": 7.0}
        assert set(got.failed) == {"p-1", "p-2"} and got.failed["p-2"] == "no pod IP"
        assert mc.scrape([_pod("p-3", ready=False)]).total is None
        # in a cluster: the pod IP and the engine port
        assert mc.pod_ip_address(_pod("p-4", ip="10.0.0.7")) == f"10.0.0.7:{s.ENGINE_PORT}"
        assert mc.pod_ip_address(_pod("p-5")) is None
    finally:
        server.shutdown()


def test_starting_pods():
    now = dt.datetime(2025, 1, 1, 0, 10, tzinfo=dt.timezone.utc)
    pods = [_pod("a", ready=False, created="2025-01-01T00:09:00Z"),  # 60 s old, not ready: starting
            _pod("b", ready=False, created="2025-01-01T00:00:00Z"),  # past its startup period
            _pod("c", ready=True, created="2025-01-01T00:09:59Z")]
    assert autoscale.starting_pods(pods, 300, now) == ["a"]


# ---------------------------------------------------------------------------------------
# HPA / KEDA builders

OWNER = b.Owner("llama", "team", "uid-1")


def _spec(**autoscaling):
    return parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "replicas": 2, "autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetRequestsPerReplica": 5, **autoscaling}})


def test_hpa_targets_the_scale_subresource_with_a_pods_metric():
    hpa = b.autoscaling_object(OWNER, _spec(provider="hpa", scaleDownStabilizationSeconds=120))
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    sp = hpa["spec"]
    assert sp["scaleTargetRef"] == {"apiVersion": "kvship.io/v1alpha1", "kind": "LLMDeployment", "name": "llama"}
    assert (sp["minReplicas"], sp["maxReplicas"]) == (1, 6)
    (m,) = sp["metrics"]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == b.HPA_METRIC
    assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "5"}
    assert sp["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert b.autoscaling_object(OWNER, _spec(provider="hpa"), hpa_api_version="autoscaling/v2beta2")["apiVersion"] \
        == "autoscaling/v2beta2"


def test_keda_scaled_object():
    so = b.autoscaling_object(OWNER, _spec(provider="keda", prometheusServerAddress="http://prom:9090"))
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
    sp = so["spec"]
    assert sp["scaleTargetRef"]["kind"] == "LLMDeployment" and (sp["minReplicaCount"], sp["maxReplicaCount"]) == (1, 6)
    (trig,) = sp["triggers"]
    assert trig["type"] == "prometheus" and trig["metadata"]["threshold"] == "5"
    assert trig["metadata"]["serverAddress"] == "http://prom:9090"
    q = trig["metadata"]["query"]
    assert "kvship:num_requests_waiting" in q and "kvship:num_requests_running" in q and 'namespace="team"' in q


def test_no_object_for_builtin_or_disabled():
    assert b.autoscaling_object(OWNER, _spec()) is None
    assert b.autoscaling_object(OWNER, _spec(enabled=False, provider="hpa")) is None


# ---------------------------------------------------------------------------------------
# tracing


def test_reconcile_span_in_memory(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    try:
        with tracing.span("reconcile LLMDeployment", tracing.reconcile_attributes("LLMDeployment", "ns", "x", 3, "create")):
            pass
        with pytest.raises(RuntimeError):
            with tracing.span("reconcile LLMDeployment", {}):
                raise RuntimeError("boom")
        spans = exporter.get_finished_spans()
        assert [sp.name for sp in spans] == ["reconcile LLMDeployment"] * 2
        assert spans[0].attributes["kvship.resource.generation"] == 3
        assert spans[0].attributes["k8s.namespace.name"] == "ns"
        assert spans[1].status.status_code.name == "ERROR"
    finally:
        tracing.shutdown()
    # off without OTEL_* settings
    for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(k, raising=False)
    assert tracing.provider_from_env() is None
    with tracing.span("x") as sp:
        assert sp is None
    tracing.shutdown()


# ---------------------------------------------------------------------------------------
# the chart: dashboard ConfigMap and autoscaling RBAC


def test_chart_dashboard_configmap_and_autoscaling_rbac():
    import json

    import yaml

    from test_operator_helm import CHART, HELM, helm

    if HELM is None:
        pytest.skip("helm not installed: run `bash .ci/k8s.sh install`")
    off = [d for d in yaml.safe_load_all(helm("template", "kvship", str(CHART)).stdout) if d]
    assert not any(d["kind"] == "ConfigMap" for d in off)
    out = helm("template", "kvship", str(CHART), "--namespace", "ops", "--set", "grafanaDashboard.enabled=true",
               "--set", "grafanaDashboard.namespace=monitoring")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "kvship-engine.json").read_text())
    assert json.loads(cm["data"]["kvship-engine.json"]) == shipped
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and not d["metadata"]["name"].endswith("-discovery")]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules[("kvship.io", "llmdeployments/scale")] == {"get", "patch"}
    assert "delete" in rules[("autoscaling", "horizontalpodautoscalers")]
    assert "delete" in rules[("keda.sh", "scaledobjects")]
    bad = helm("template", "kvship", str(CHART), "--set", "grafanaDashboard.bogus=1", check=False)
    assert bad.returncode != 0
