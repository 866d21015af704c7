"""The Helm chart: lint, rendered manifests validated against Kubernetes schemas, and a real
`helm install` whose ServiceAccount is enough to run the operator (and no more)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from kubernetes.client import ApiClient, CoreV1Api

import k8s_cluster
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import REPO, wait_for
from kvship_operator.kube import load_configuration, request

CHART = REPO / "charts" / "kvship-operator"
HELM = k8s_cluster.helm_path()
if HELM is None:  # loud: the install step should have provided it
    print("\n*** helm missing: run `bash .ci/k8s.sh install`; Helm tests are SKIPPED ***\n", file=sys.stderr)
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not installed: run `bash .ci/k8s.sh install`")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, check=check, timeout=120)


@needs_helm
def test_lint_strict():
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out.stdout, out.stdout + out.stderr
    out = helm("lint", "--strict", str(CHART), "--set", "watchNamespaces={team-a,team-b}")
    assert "0 chart(s) failed" in out.stdout, out.stdout + out.stderr


@needs_helm
@pytest.mark.parametrize("k8s_version", ["1.25.0", None])
@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a,team-b}", "--set", "logLevel=DEBUG"]])
def test_template_validates(values, k8s_version):
    import kubernetes_validate

    version = k8s_version or kubernetes_validate.latest_version()
    out = helm("template", "kvship", str(CHART), "--namespace", "kvship-system", "--include-crds", *values)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)
    assert "CustomResourceDefinition" in kinds and "Deployment" in kinds and "ServiceAccount" in kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    if values:
        assert "--namespace=team-a" in c["args"] and "--log-level=DEBUG" in c["args"]
        roles = [d for d in docs if d["kind"] == "Role"]
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        assert kinds.count("ClusterRole") == 1  # only the read-only discovery role
    else:
        assert "Role" not in kinds and kinds.count("ClusterRole") == 2


def _access(api: ApiClient, verb: str, resource: str, group: str = "", namespace: str | None = None,
            subresource: str = "") -> bool:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": verb, "resource": resource, "group": group,
                                            "namespace": namespace, "subresource": subresource}}}
    out = request(api, "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=body)
    return bool(out["status"].get("allowed"))


@needs_helm
@pytest.mark.parametrize("mode", ["all-namespaces", "watched-namespace"])
def test_helm_install_operator_runs_as_its_service_account(cluster, api, crd_installed, objects, run_operator, tmp_path,
                                                           mode):
    release_ns = "kvship-system"
    kubeconfig = str(cluster.kubeconfig)
    extra = ["--set", f"watchNamespaces={{{objects.ns}}}"] if mode == "watched-namespace" else []
    out = helm("install", "kvship", str(CHART), "-n", release_ns, "--create-namespace", "--kubeconfig", kubeconfig,
               *extra, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        core = CoreV1Api(api)
        sa = core.read_namespaced_service_account("kvship-kvship-operator", release_ns)
        dep = request(api, "GET", f"/apis/apps/v1/namespaces/{release_ns}/deployments/kvship-kvship-operator")
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa.metadata.name

        # credentials of that ServiceAccount (TokenRequest API)
        token = wait_for(lambda: core.create_namespaced_service_account_token(
            sa.metadata.name, release_ns, {"spec": {"expirationSeconds": 3600}}).status.token, 20, what="SA token")
        admin_cfg = load_configuration(kubeconfig)
        sa_kubeconfig = tmp_path / "sa.kubeconfig"
        sa_kubeconfig.write_text(k8s_cluster.kubeconfig_text(admin_cfg.host, admin_cfg.ssl_ca_cert, token=token,
                                                             user="kvship-operator"))
        sa_api = ApiClient(load_configuration(str(sa_kubeconfig)))

        ns = objects.ns
        assert _access(sa_api, "patch", "statefulsets", "apps", ns)
        assert _access(sa_api, "patch", "llmdeployments", "kvship.io", ns, "status")
        for verb, resource, group, sub in [
            ("get", "secrets", "", ""),
            ("delete", "statefulsets", "apps", ""),
            ("create", "pods", "", ""),
            ("delete", "llmdeployments", "kvship.io", ""),
            ("update", "llmdeployments", "kvship.io", ""),
            ("create", "customresourcedefinitions", "apiextensions.k8s.io", ""),
            ("create", "deployments", "apps", ""),
            ("create", "pods", "", "exec"),
        ]:
            assert not _access(sa_api, verb, resource, group, ns, sub), f"SA may {verb} {resource}/{sub}"

        if mode == "watched-namespace":  # nothing outside the watched namespace
            assert not _access(sa_api, "patch", "statefulsets", "apps", "default")
            assert not _access(sa_api, "list", "pods", "", None)
        else:
            assert not _access(sa_api, "list", "namespaces", "", None)

        # the operator, authenticated as the ServiceAccount, does its whole job
        run_operator(sa_kubeconfig, namespaces=[ns] if mode == "watched-namespace" else None)
        objects.create_llmd("rbac", {"model": {"url": "https://models.invalid/m.gguf"}, "gpu": {"count": 0}})
        for plural, api_version, name in [("statefulsets", "apps/v1", "rbac"), ("services", "v1", "rbac"),
                                          ("services", "v1", "rbac-engines"),
                                          ("persistentvolumeclaims", "v1", "rbac-model-cache")]:
            wait_for(lambda: objects.get(api_version, plural, name), 30, what=f"{plural}/{name}")
        cr = wait_for(lambda: (c := objects.llmd("rbac")).get("status", {}).get("observedGeneration") == 1 and c, 30,
                      what="status written by the SA")
        assert {c["type"] for c in cr["status"]["conditions"]} == {"Ready", "ModelCached", "WorkloadReady"}
        wait_for(lambda: any(e["reason"] == "Applied" for e in objects.events("rbac")), 20, what="event posted")
        sa_api.close()
    finally:
        helm("uninstall", "kvship", "-n", release_ns, "--kubeconfig", kubeconfig, "--wait", check=False)


@needs_helm
def test_bad_values_refused():
    out = helm("template", "kvship", str(CHART), "--set", "logLevel=LOUD", check=False)
    assert out.returncode != 0 and "logLevel" in out.stderr, out.stderr
    out = helm("template", "kvship", str(CHART), "--set", "watchNamespaces={Bad_Name}", check=False)
    assert out.returncode != 0 and "watchNamespaces" in out.stderr, out.stderr
