"""Fixtures for the operator tests: a real control plane on loopback (session), the CRD,
per-test namespaces, and the operator running in-process (kopf.operator in a thread).

Integration tests skip when the Kubernetes binaries are missing, except under CI=true where
that is a failure (`.ci/run` installs them with `bash .ci/k8s.sh install`)."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import kopf
import pytest
import yaml
from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi, ApiextensionsV1Api
from kubernetes.client.exceptions import ApiException

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k8s_cluster  # noqa: E402

from kvship_operator import crd as crd_mod  # noqa: E402
from kvship_operator import handlers  # noqa: E402
from kvship_operator import spec as s  # noqa: E402
from kvship_operator.kube import load_configuration, request  # noqa: E402

REPO = k8s_cluster.REPO


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll until predicate() returns something truthy; ApiExceptions count as not yet."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ApiException as e:
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


@pytest.fixture(scope="session")
def cluster():
    if not os.environ.get("KUBECONFIG") and not k8s_cluster.binaries_present():
        msg = f"Kubernetes test binaries missing in {k8s_cluster.bindir()}: {k8s_cluster.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    c = k8s_cluster.start()
    if c.started_in:
        print(f"\n[k8s] control plane up in {c.started_in:.1f} s ({c.server})", file=sys.stderr)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def api(cluster) -> ApiClient:
    client = ApiClient(load_configuration(str(cluster.kubeconfig)))
    # the default service account exists once the controller-manager's SA controller runs
    yield client
    client.close()


@pytest.fixture(scope="session")
def crd_installed(api) -> dict:
    """Create (or replace) the generated CRD and wait until it is Established."""
    ext = ApiextensionsV1Api(api)
    body = crd_mod.crd()
    name = body["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as e:
        if e.status != 409:
            raise
        current = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, body)

    def established():
        got = api.sanitize_for_serialization(ext.read_custom_resource_definition(name))
        return any(c["type"] == "Established" and c["status"] == "True" for c in got.get("status", {}).get("conditions", []))

    wait_for(established, 30, what="CRD Established")
    return body


@pytest.fixture
def namespace(api, crd_installed):
    core = CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    try:
        core.delete_namespace(name)
    except ApiException:
        pass


class OperatorThread:
    """kopf.operator with the project's registry, in a thread, with its own credentials."""

    def __init__(self, kubeconfig: Path | str, *, namespaces: list[str] | None = None):
        self.kubeconfig = str(kubeconfig)
        self.namespaces = namespaces or []
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="kvship-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(
                kopf.operator(
                    registry=handlers.registry,
                    clusterwide=not self.namespaces,
                    namespaces=self.namespaces,
                    standalone=True,
                    stop_flag=self.stop_flag,
                    ready_flag=self.ready_flag,
                    memo=kopf.Memo(kubeconfig=self.kubeconfig),
                )
            )
        except BaseException as e:  # reported by stop()
            self.error = e

    def start(self, timeout: float = 30) -> "OperatorThread":
        self.thread.start()
        if not self.ready_flag.wait(timeout):
            raise AssertionError(f"operator not ready in {timeout} s (error: {self.error!r})")
        return self

    def stop(self, timeout: float = 30) -> None:
        self.stop_flag.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "operator thread did not stop"


@pytest.fixture
def run_operator(cluster):
    """Factory: start operators (stopped at teardown)."""
    started: list[OperatorThread] = []
    logging.getLogger("kopf").setLevel(logging.INFO)

    def start(kubeconfig: Path | str | None = None, **kw: Any) -> OperatorThread:
        op = OperatorThread(kubeconfig or cluster.kubeconfig, **kw).start()
        started.append(op)
        return op

    yield start
    for op in started:
        if op.thread.is_alive():
            op.stop()


# ------------------------------------------------------------------------------------------
# small API helpers used by the tests


class Objects:
    def __init__(self, api: ApiClient, namespace: str):
        self.api = api
        self.ns = namespace
        self.co = CustomObjectsApi(api)

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        return request(self.api, method, path, body=body, content_type=content_type)

    def get(self, api_version: str, plural: str, name: str) -> dict | None:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            return self._call("GET", f"{base}/namespaces/{self.ns}/{plural}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, selector: str = "") -> list[dict]:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        q = f"?labelSelector={selector}" if selector else ""
        return self._call("GET", f"{base}/namespaces/{self.ns}/{plural}{q}")["items"]

    def create_llmd(self, name: str, spec: dict) -> dict:
        body = {"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": name}, "spec": spec}
        return self.co.create_namespaced_custom_object(s.GROUP, s.VERSION, self.ns, s.PLURAL, body)

    def llmd(self, name: str) -> dict | None:
        return self.get(s.API_VERSION, s.PLURAL, name)

    def patch_llmd_spec(self, name: str, spec_patch: dict) -> dict:
        return self._call("PATCH", f"/apis/{s.API_VERSION}/namespaces/{self.ns}/{s.PLURAL}/{name}",
                          {"spec": spec_patch}, "application/merge-patch+json")

    def delete_llmd(self, name: str) -> None:
        self.co.delete_namespaced_custom_object(s.GROUP, s.VERSION, self.ns, s.PLURAL, name)

    def patch_pod_status(self, name: str, status: dict) -> dict:
        return self._call("PATCH", f"/api/v1/namespaces/{self.ns}/pods/{name}/status", {"status": status},
                          "application/merge-patch+json")

    def events(self, involved: str) -> list[dict]:
        items = self._call("GET", f"/api/v1/namespaces/{self.ns}/events")["items"]
        return [e for e in items if e["involvedObject"].get("name") == involved]


@pytest.fixture
def objects(api, namespace) -> Objects:
    return Objects(api, namespace)


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]
