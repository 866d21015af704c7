"""`kvship router` as a command: bad endpoints are refused, an empty pool answers through Envoy
with an OpenAI-shaped 503, --picker-only runs the picker without Envoy, SIGTERM stops everything."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from procs import live_children
from server_utils import assert_error, free_port

pytestmark = pytest.mark.timeout(120)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvship.cli", "router", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            return httpx.get(url, timeout=2)
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout}s")


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate(timeout=10)[0]
    return proc.returncode, out


def test_endpoint_without_port_is_refused():
    proc = start("--endpoint", "http://127.0.0.1", "--port", str(free_port()))
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2 and "host and a port" in out


def test_empty_pool_answers_503_through_envoy_and_stops_cleanly():
    port, metrics = free_port(), free_port()
    proc = start("--host", "127.0.0.1", "--port", str(port), "--picker-port", str(free_port()),
                 "--metrics-port", str(metrics))
    try:
        assert wait_http(f"http://127.0.0.1:{metrics}/health", proc).status_code == 503
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)
        assert live_children(proc.pid), "envoy runs beside the picker"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=10,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        err = assert_error(r, 503, param=None)
        assert err["code"] == "no_endpoint" and r.headers["retry-after"] == "1"
        assert 'kvship_router:picks_total{endpoint="",reason="no-endpoint"}' in \
            httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_hold_timeout_through_envoy_is_a_503_with_retry_after():
    port, metrics = free_port(), free_port()
    proc = start("--host", "127.0.0.1", "--port", str(port), "--picker-port", str(free_port()),
                 "--metrics-port", str(metrics), "--endpoint", f"127.0.0.1:{free_port()}", "--hold-timeout", "1.5")
    try:
        wait_http(f"http://127.0.0.1:{metrics}/health", proc)
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc)  # held too, then 503
        start_at = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=20, json={"model": "m", "prompt": "hi"})
        assert time.monotonic() - start_at >= 1.5
        err = assert_error(r, 503, param=None)
        assert err["code"] == "no_endpoint" and "1.5s" in err["message"] and r.headers["retry-after"] == "2"
        assert 'reason="hold-timeout"' in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    finally:
        code, out = stop(proc)
    assert code == 0, out


def test_picker_only_runs_no_envoy():
    picker, metrics = free_port(), free_port()
    proc = start("--picker-only", "--picker-host", "127.0.0.1", "--picker-port", str(picker),
                 "--metrics-port", str(metrics), "--endpoint", "127.0.0.1:1", "--scrape-interval", "30")
    try:
        wait_http(f"http://127.0.0.1:{metrics}/health", proc)
        assert not live_children(proc.pid)
        with grpc.insecure_channel(f"127.0.0.1:{picker}") as channel:
            headers = pb.HttpHeaders(end_of_stream=True, headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/models")]))
            out = list(pb_grpc.ExternalProcessorStub(channel).Process(
                iter([pb.ProcessingRequest(request_headers=headers)]), timeout=10))
        # The only endpoint's /metrics does not answer: it is out of the pool.
        assert out[-1].HasField("immediate_response"), out
        assert json.loads(out[-1].immediate_response.body)["error"]["code"] == "no_endpoint"
    finally:
        code, out = stop(proc)
    assert code == 0, out
