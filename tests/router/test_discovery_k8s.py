"""`kvship router --discover-k8s NAMESPACE/SERVICE:PORT` (issue 51): which addresses a Service's
EndpointSlices give the pool (ready, not terminating, the named port), as the API serves them."""
from __future__ import annotations

import pytest

from kvship.router.discovery_k8s import parse_k8s_target, pool_addresses, slice_addresses

pytestmark = pytest.mark.timeout(30)


def _slice(endpoints: list[dict], ports: list[dict] | None = None) -> dict:
    return {"addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports}


def test_parse_target():
    assert parse_k8s_target("team-a/qwen-serving:http") == ("team-a", "qwen-serving", "http")
    assert parse_k8s_target("team-a/qwen-serving:8000") == ("team-a", "qwen-serving", "8000")
    for bad in ("qwen-serving:http", "team-a/qwen-serving", "/qwen-serving:http", "team-a/:http", "a/b/c:http"):
        with pytest.raises(ValueError, match="NAMESPACE/SERVICE:PORT"):
            parse_k8s_target(bad)


def test_ready_endpoints_on_the_named_port():
    s = _slice([
        {"addresses": ["10.1.0.5"], "conditions": {"ready": True}},
        {"addresses": ["10.1.0.6"], "conditions": {"ready": False}},  # starting: not picked
        {"addresses": ["10.1.0.7"], "conditions": {}},  # unknown counts as ready (the API's advice)
        {"addresses": ["10.1.0.8"], "conditions": {"ready": True, "terminating": True}},
    ], ports=[{"name": "metrics", "port": 9090}, {"name": "http", "port": 8001}])
    assert slice_addresses(s, "http") == ["10.1.0.5:8001", "10.1.0.7:8001"]
    assert slice_addresses(s, "8000") == ["10.1.0.5:8000", "10.1.0.7:8000"]  # a number is the pods' port
    assert slice_addresses(s, "grpc") == []  # no such port: nothing to route to
    assert slice_addresses({"endpoints": None, "ports": None}, "http") == []  # a Service with no pods yet


def test_ipv6_and_the_union_over_slices():
    v6 = _slice([{"addresses": ["fd00::5"], "conditions": {"ready": True}}])
    assert slice_addresses(v6, "http") == ["[fd00::5]:8000"]
    a = _slice([{"addresses": ["10.1.0.9"], "conditions": {"ready": True}},
                {"addresses": ["10.1.0.2"], "conditions": {"ready": True}}])
    b = _slice([{"addresses": ["10.1.0.2"], "conditions": {"ready": True}}])  # seen in two slices: once
    assert pool_addresses({"a": a, "b": b, "v6": v6}, "http") == ["10.1.0.2:8000", "10.1.0.9:8000", "[fd00::5]:8000"]
    assert pool_addresses({}, "http") == []
