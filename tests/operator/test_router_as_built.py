"""The router and engine as the operator builds them, run for real (issue 51): the router
Deployment's and the engine container's arguments (KV-cache events, the hold for scale from
zero) are taken as built, only their addresses moved to loopback. A request sent while no replica
runs is held by the router; the operator's reader sees it as pending (what brings the first
replica up in a cluster, test_routing_cluster); it is answered once the replica is ready."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from kvship_operator import builders as b
from kvship_operator import router_builders as rb
from kvship_operator import scale_zero
from kvship_operator import spec as s
from kvship_operator.schema import parse
from operator_helpers import wait_for
from server_utils import free_port

pytest.importorskip("grpc")
pytestmark = pytest.mark.timeout(300)


def _set(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _discover_at(args: list[str], address: str) -> None:
    """The replicas by address (--discover) where the cluster's EndpointSlices would name them."""
    i = args.index("--discover-k8s")
    args[i:i + 2] = ["--discover", address]


def _start(args: list[str]) -> tuple[subprocess.Popen, tempfile._TemporaryFileWrapper]:
    log = tempfile.NamedTemporaryFile(prefix="kvship-as-built-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "kvship.cli", *args], stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_request_held_at_zero_is_seen_pending_then_answered(bundled):
    spec = parse(s.LLMDeploymentSpec, {
        "model": {"hub": "a/b"}, "servedModelName": "smol", "gpu": {"count": 0}, "replicas": 0,
        "engine": {"args": ["--max-model-len", "512", "--kv-cache-memory", "256MiB"]},
        "routing": {"mode": "envoy", "holdSeconds": 150},
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1}})
    objs = {(o["kind"], o["metadata"]["name"]): o for o in rb.children(b.Owner("smol", "default", "u"), spec)}
    engine_args = list(objs[("StatefulSet", "smol")]["spec"]["template"]["spec"]["containers"][0]["args"])
    router_args = list(objs[("Deployment", "smol-router")]["spec"]["template"]["spec"]["containers"][0]["args"])

    engine_port, kv_port = free_port(), free_port()
    router_port, picker_port, metrics_port = free_port(), free_port(), free_port()
    engine_args[1] = bundled
    _set(engine_args, "--host", "127.0.0.1")
    _set(engine_args, "--port", str(engine_port))
    events = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
    _set(engine_args, "--kv-events-config", json.dumps({**events, "endpoint": f"tcp://127.0.0.1:{kv_port}"}))
    _discover_at(router_args, f"127.0.0.1:{engine_port}")
    for flag, value in [("--host", "127.0.0.1"),
                        ("--port", str(router_port)), ("--picker-host", "127.0.0.1"),
                        ("--picker-port", str(picker_port)), ("--metrics-port", str(metrics_port)),
                        ("--kv-events-port", str(kv_port))]:
        _set(router_args, flag, value)
    assert router_args[router_args.index("--hold-timeout") + 1] == "150"

    router_pod = {"metadata": {"name": "smol-router-0"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    def pending() -> float | None:
        signal = scale_zero.read_routers([router_pod], lambda _: f"127.0.0.1:{metrics_port}")
        return None if signal is None else signal.pending

    router, router_log = _start(router_args)
    engine = engine_log = None
    answer: dict = {}

    def ask() -> None:
        body = {"model": "smol", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
        try:
            answer["response"] = httpx.post(f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body,
                                            timeout=200)
        except httpx.HTTPError as e:
            answer["error"] = repr(e)

    client = threading.Thread(target=ask, daemon=True)
    try:
        wait_for(lambda: pending() == 0, 60, what="the router's /metrics",
                 show=lambda: (router.poll(), open(router_log.name).read()[-2000:]))
        # Envoy listens only after the picker's /metrics is up (the pod's readiness probe is this port).
        wait_for(lambda: _listening(router_port), 60, what="envoy listening",
                 show=lambda: (router.poll(), open(router_log.name).read()[-2000:]))
        client.start()
        wait_for(lambda: pending() == 1, 90, what="the request held and reported pending",
                 show=lambda: (answer, router.poll(), open(router_log.name).read()[-2000:]))
        t_held = time.monotonic()
        engine, engine_log = _start(engine_args)  # what the operator does on that signal: a replica
        client.join(200)
        assert not client.is_alive() and "error" not in answer, (answer, open(engine_log.name).read()[-2000:])
        resp = answer["response"]
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvship-endpoint"] == f"127.0.0.1:{engine_port}"
        assert resp.json()["choices"][0]["message"]["content"]
        assert pending() == 0
        print(f"\n[as built] held request answered {time.monotonic() - t_held:.1f} s after the replica was started")
    finally:
        for proc in (engine, router):
            if proc is not None:
                _stop(proc)
        for log in (engine_log, router_log):
            if log is not None:
                log.close()


def test_gateway_picker_as_built_names_a_discovered_replica():
    """Mode gateway: the picker alone, as a gateway's ext_proc calls it through the InferencePool's
    endpointPickerRef, answering with a replica it discovered (a /metrics stand-in here)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from test_scale_zero import RouterPage

    spec = parse(s.LLMDeploymentSpec, {"model": {"hub": "a/b"}, "routing": {"mode": "gateway", "kvEvents": False}})
    owner = b.Owner("g", "default", "u")
    router_args = list(rb.router_deployment(owner, spec)["spec"]["template"]["spec"]["containers"][0]["args"])
    pool = rb.inference_pool(owner, spec)
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == rb.PICKER_PORT
    replica = RouterPage('kvship:num_requests_waiting{model_name="m"} 0\nkvship:num_requests_running{model_name="m"} 0\n')
    picker_port, metrics_port = free_port(), free_port()
    _discover_at(router_args, replica.address)
    for flag, value in [("--picker-host", "127.0.0.1"),
                        ("--picker-port", str(picker_port)), ("--metrics-port", str(metrics_port))]:
        _set(router_args, flag, value)
    assert "--picker-only" in router_args
    router, log = _start(router_args)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{metrics_port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False  # not listening yet

        wait_for(healthy, 60, what="the picker healthy once it scraped the replica",
                 show=lambda: (router.poll(), open(log.name).read()[-2000:]))
        headers = [base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                   base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")]
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
        with grpc.insecure_channel(f"127.0.0.1:{picker_port}") as channel:
            out = list(pb_grpc.ExternalProcessorStub(channel).Process(iter([
                pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers))),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]), timeout=10))
        mutation = out[-1].request_body.response.header_mutation.set_headers
        picked = {h.header.key: h.header.raw_value.decode() for h in mutation}
        assert picked["x-gateway-destination-endpoint"] == replica.address
    finally:
        _stop(router)
        log.close()
        replica.close()
