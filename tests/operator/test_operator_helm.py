"""The Helm chart: lint, rendered manifests validated against Kubernetes schemas, and a real
`helm install` whose ServiceAccount is enough to run the operator (and no more)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from kubernetes.client import ApiClient, CoreV1Api

import k8s_cluster
from kvship_operator import spec as s
from kvship_operator import status as status_mod
from kvship_operator.kube import load_configuration, request
from operator_fixtures import (  # noqa: F401 - pytest finds fixtures by name in the module
    api,
    cluster,
    crd_installed,
    namespace,
    objects,
    run_operator,
)
from operator_helpers import REPO, wait_for

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
    # the admission webhook (issue 58 item 3): a certificate, a Service to the operator's
    # webhook port, and the configuration that sends LLMDeployment writes there
    (hook,) = next(d for d in docs if d["kind"] == "ValidatingWebhookConfiguration")["webhooks"]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert hook["failurePolicy"] == "Ignore" and hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert hook["clientConfig"]["service"]["path"] == "/validate-llmdeployment"
    assert "--webhook-port=9443" in c["args"] and "--webhook-cert-dir=/etc/kvship/webhook" in c["args"]
    assert (hook.get("namespaceSelector") is not None) == bool(values)  # helm renders for a server >= 1.21 here
    old = helm("template", "kvship", str(CHART), "--kube-version", "1.20.0", *values).stdout
    assert "kubernetes.io/metadata.name" not in old  # 1.20 has no such label: every namespace is checked
    out = helm("template", "kvship", str(CHART), "--set", "webhook.enabled=false")
    assert "ValidatingWebhookConfiguration" not in out.stdout and "--webhook-port" not in out.stdout


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
    # the session's CRD is already installed (crd_installed): the release does not take it over
    # no operator pod runs here to answer the chart's webhook (test_admission_webhook covers it)
    extra = ["--set", "crds.install=false", "--set", "webhook.enabled=false"]
    extra += ["--set", f"watchNamespaces={{{objects.ns}}}"] if mode == "watched-namespace" else []
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
        # spec.routing: the router Deployment and mode gateway's InferencePool
        assert _access(sa_api, "create", "deployments", "apps", ns)
        assert _access(sa_api, "patch", "inferencepools", "inference.networking.k8s.io", ns)
        for verb, resource, group, sub in [
            ("get", "secrets", "", ""),
            ("delete", "statefulsets", "apps", ""),
            ("create", "pods", "", ""),
            ("delete", "llmdeployments", "kvship.io", ""),
            ("update", "llmdeployments", "kvship.io", ""),
            ("create", "customresourcedefinitions", "apiextensions.k8s.io", ""),
            ("create", "daemonsets", "apps", ""),
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
                                          ("persistentvolumeclaims", "v1", "model-cache-rbac-0")]:
            wait_for(lambda: objects.get(api_version, plural, name), 30, what=f"{plural}/{name}")
        # the per-replica cache claim adopted (so that it goes away with the LLMDeployment)
        wait_for(lambda: objects.get("v1", "persistentvolumeclaims", "model-cache-rbac-0")["metadata"].get(
            "ownerReferences"), 30, what="claim adopted")
        cr = wait_for(lambda: (c := objects.llmd("rbac")).get("status", {}).get("observedGeneration") == 1 and c, 30,
                      what="status written by the SA")
        assert {c["type"] for c in cr["status"]["conditions"]} == set(status_mod.TYPES)
        wait_for(lambda: any(e["reason"] == "Applied" for e in objects.events("rbac")), 20, what="event posted")
        sa_api.close()
    finally:
        helm("uninstall", "kvship", "-n", release_ns, "--kubeconfig", kubeconfig, "--wait", check=False)


@needs_helm
@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a}"]])
def test_rbac_covers_routing(values):
    """spec.routing (issue 51): the router Deployment is applied, watched and deleted like the
    other children, mode gateway's InferencePool made, and the router's Services deleted when
    routing turns off."""
    out = helm("template", "kvship", str(CHART), *values)
    (role,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in ("Role", "ClusterRole")
               and not d["metadata"]["name"].endswith("-discovery")]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    for verb in ("get", "list", "watch", "create", "patch", "delete"):
        assert ("apps", "deployments", verb) in granted
    for verb in ("get", "create", "patch", "delete"):
        assert ("inference.networking.k8s.io", "inferencepools", verb) in granted
    assert ("", "services", "delete") in granted and ("", "persistentvolumeclaims", "delete") not in granted
    # the router's ServiceAccount, Role and RoleBinding; a Role is granted only by one holding its rules
    for verb in ("get", "create", "patch", "delete"):
        assert ("", "serviceaccounts", verb) in granted
        assert ("rbac.authorization.k8s.io", "roles", verb) in granted
        assert ("rbac.authorization.k8s.io", "rolebindings", verb) in granted
    for verb in ("get", "list", "watch"):
        assert ("discovery.k8s.io", "endpointslices", verb) in granted


@needs_helm
def test_bad_values_refused():
    out = helm("template", "kvship", str(CHART), "--set", "logLevel=LOUD", check=False)
    assert out.returncode != 0 and "logLevel" in out.stderr, out.stderr
    out = helm("template", "kvship", str(CHART), "--set", "watchNamespaces={Bad_Name}", check=False)
    assert out.returncode != 0 and "watchNamespaces" in out.stderr, out.stderr


@needs_helm
def test_crd_is_a_template_that_fits_the_server(cluster, tmp_path):
    """Item 9 (#20): the CRD did not install on servers older than 1.25 (CEL rules) although
    the chart claims kubeVersion >= 1.20, and Helm never upgrades files under crds/. The CRD
    is now a template (upgraded with the release, kept on uninstall) that leaves the CEL rules
    out below 1.25; validated here against the real 1.20 server the way `helm install` does."""
    from kvship_operator import crd as crd_mod

    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_meta["kubeVersion"] == ">=1.20.0-0"
    assert not (CHART / "crds").exists(), "Helm would install crds/ once and never upgrade it"

    def rendered_crd(*args: str) -> dict:
        out = helm("template", "kvship", str(CHART), *args)
        (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "CustomResourceDefinition"]
        return doc

    new, old = rendered_crd("--kube-version", "1.25.0"), rendered_crd("--kube-version", "1.20.0")
    for doc in (new, old):
        assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "x-kubernetes-validations" in json.dumps(new) and "x-kubernetes-validations" not in json.dumps(old)
    assert crd_mod.strip_cel(new["spec"]) == old["spec"]
    without = helm("template", "kvship", str(CHART), "--set", "crds.install=false").stdout
    assert not [d for d in yaml.safe_load_all(without) if d and d["kind"] == "CustomResourceDefinition"]

    # a real install, upgrade and uninstall on a fresh 1.20 control plane (the session's
    # cluster already has the CRD, installed by the tests themselves)
    import shutil

    own = k8s_cluster.start()
    try:
        kc = ["--kubeconfig", str(own.kubeconfig)]
        files = CHART / "files" / "crds"
        # the variant with CEL is what such a server refuses (the reported failure)
        cel_chart = tmp_path / "cel-chart"
        shutil.copytree(CHART, cel_chart)
        old_slot = cel_chart / "files" / "crds" / f"pre-{crd_mod.CEL_SINCE}" / crd_mod.FILENAME
        shutil.copy(files / crd_mod.FILENAME, old_slot)
        out = helm("install", "cel", str(cel_chart), "-n", "kvship-system", "--create-namespace", *kc, check=False)
        assert out.returncode != 0 and "x-kubernetes-validations" in out.stderr, out.stdout[-500:] + out.stderr

        out = helm("install", "kvship", str(CHART), "-n", "kvship-system", "--create-namespace", *kc, check=False)
        assert out.returncode == 0, out.stderr
        ext = ApiClient(load_configuration(str(own.kubeconfig)))
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{s.PLURAL}.{s.GROUP}"
        got = wait_for(lambda: request(ext, "GET", path), 20, what="CRD installed by helm")
        columns = [c["name"] for c in got["spec"]["versions"][0]["additionalPrinterColumns"]]

        # a chart whose CRD changed: `helm upgrade` delivers it
        upgraded = tmp_path / "upgraded"
        shutil.copytree(CHART, upgraded)
        target = upgraded / "files" / "crds" / f"pre-{crd_mod.CEL_SINCE}" / crd_mod.FILENAME
        changed = yaml.safe_load(target.read_text())
        changed["spec"]["versions"][0]["additionalPrinterColumns"].append(
            {"name": "Upgraded", "type": "string", "jsonPath": ".status.endpoint", "priority": 1})
        target.write_text(yaml.safe_dump(changed, sort_keys=False))
        out = helm("upgrade", "kvship", str(upgraded), "-n", "kvship-system", *kc, check=False)
        assert out.returncode == 0, out.stderr
        got = request(ext, "GET", path)
        assert [c["name"] for c in got["spec"]["versions"][0]["additionalPrinterColumns"]] == columns + ["Upgraded"]

        # uninstall keeps it (and with it every LLMDeployment)
        out = helm("uninstall", "kvship", "-n", "kvship-system", *kc, check=False)
        said = out.stdout + out.stderr
        assert out.returncode == 0 and "kept due to the resource policy" in said, said
        assert request(ext, "GET", path)["metadata"]["name"] == f"{s.PLURAL}.{s.GROUP}"
        ext.close()
    finally:
        own.stop()
