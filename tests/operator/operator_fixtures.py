"""Fixtures for the operator tests: a real control plane on loopback (one per session), the
CRD, per-test namespaces, and the operator running in-process (kopf.operator in a thread).

Test modules import the fixtures they use from here. (A conftest.py in tests/operator would
be imported as the module `conftest` too, shadowing tests/conftest.py for the test modules
that import from it.)

Integration tests skip when the Kubernetes binaries are missing, except under CI=true where
that is a failure (`.ci/run` installs them with `bash .ci/k8s.sh install`)."""
from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient, ApiextensionsV1Api, CoreV1Api
from kubernetes.client.exceptions import ApiException

import k8s_cluster
from kvship_operator import crd as crd_mod
from kvship_operator.kube import load_configuration
from operator_helpers import Objects, OperatorThread, assert_no_operator_threads, wait_for

_cluster: k8s_cluster.Cluster | None = None


def _shared_cluster() -> k8s_cluster.Cluster:
    """One control plane for the whole run, whichever test module asks first."""
    global _cluster
    if _cluster is None:
        _cluster = k8s_cluster.start()
        if _cluster.started_in:
            print(f"\n[k8s] control plane up in {_cluster.started_in:.1f} s ({_cluster.server})", file=sys.stderr)
    return _cluster


@pytest.fixture(scope="session")
def cluster():
    if not os.environ.get("KUBECONFIG") and not k8s_cluster.binaries_present():
        msg = f"Kubernetes test binaries missing in {k8s_cluster.bindir()}: {k8s_cluster.INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    yield _shared_cluster()
    # session teardown: stop it (further stop calls, and the atexit one, do nothing)
    if _cluster is not None:
        _cluster.stop()


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


@pytest.fixture
def run_operator(cluster, request):
    """Factory: start operators (stopped at teardown). In a test with a ``namespace`` an
    operator watches that namespace alone unless the test names ``namespaces`` (None: the whole
    cluster): one cluster serves every test, and an operator watching all of it took up the
    objects of the test before, in a namespace being deleted (CI, 2026-12-04: events refused
    there held its stop)."""
    started: list[OperatorThread] = []
    logging.getLogger("kopf").setLevel(logging.INFO)

    def start(kubeconfig: Path | str | None = None, **kw: Any) -> OperatorThread:
        if "namespaces" not in kw and "namespace" in request.fixturenames:
            kw["namespaces"] = [request.getfixturevalue("namespace")]
        op = OperatorThread(kubeconfig or cluster.kubeconfig, **kw).start()
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    assert_no_operator_threads()  # nothing any of them started is left


# ------------------------------------------------------------------------------------------
# small API helpers used by the tests


@pytest.fixture
def objects(api, namespace) -> Objects:
    return Objects(api, namespace)
