"""What the API server (and kubectl) refuse, against the real 1.20 server (issue #20, item 7):
names whose children would be invalid, and typos in tolerations/affinity."""
from __future__ import annotations

import json
import subprocess

import pytest
from kubernetes.client.exceptions import ApiException

import k8s_cluster
from kvship_operator import spec as s
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from test_operator_cluster import cond

SPEC = {"model": {"hub": "a/b"}}


@pytest.mark.parametrize("name, expect", [
    ("a" * 58, f"metadata.name in body should be at most {s.MAX_NAME_LENGTH} chars long"),
    ("qwen.v1", "metadata.name: Invalid value: \"qwen.v1\""),
])
def test_names_that_make_invalid_children_are_refused(objects, name, expect):
    """The steps that showed it: a 58-character name, and `qwen.v1`, were accepted and the
    children could not be created (ApplyFailed and a stray PVC)."""
    with pytest.raises(ApiException) as e:
        objects.create_llmd(name, SPEC)
    assert e.value.status == 422
    message = json.loads(e.value.body)["message"]
    assert expect in message, message
    assert objects.list("v1", "persistentvolumeclaims") == []


def test_bad_toleration_effect_refused(objects):
    with pytest.raises(ApiException) as e:
        bad = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedul"}]
        objects.create_llmd("tol", {**SPEC, "tolerations": bad})
    assert e.value.status == 422
    assert 'spec.tolerations.effect: Unsupported value: "NoSchedul"' in json.loads(e.value.body)["message"]


def _kubectl():
    found = sorted(k8s_cluster.bindir().parents[1].glob("*/bin/kubectl"))
    return found[0] if found else None


@pytest.mark.skipif(_kubectl() is None, reason="kubectl not in the Kubernetes test binaries")
def test_kubectl_validation_refuses_unknown_fields(cluster, objects, tmp_path):
    """A misspelt field (`efect`) is unknown to the CRD's schema: kubectl's validation
    refuses it (client-side on this 1.20 server; servers >= 1.25 refuse it themselves with
    --validate=strict). A client that validates nothing has it pruned: docs/operator.md says so."""
    manifest = tmp_path / "llmd.yaml"
    manifest.write_text(json.dumps({"apiVersion": s.API_VERSION, "kind": s.KIND, "metadata": {"name": "typo"},
                                    "spec": {**SPEC, "tolerations": [{"key": "gpu", "operator": "Exists",
                                                                      "efect": "NoSchedule"}]}}))
    def kubectl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(_kubectl()), "--kubeconfig", str(cluster.kubeconfig), "-n", objects.ns, *args],
                              capture_output=True, text=True, timeout=60)

    # the server publishes a new CRD schema to its OpenAPI document a few seconds after it is stored
    wait_for(lambda: kubectl("explain", "llmd.spec.tolerations.effect").returncode == 0, 30,
             what="the CRD schema published")
    out = kubectl("apply", "--validate=true", "-f", str(manifest))
    assert out.returncode != 0 and 'unknown field "efect"' in out.stderr, out.stdout + out.stderr
    assert objects.llmd("typo") is None


@pytest.mark.parametrize("args, expect", [
    (["-tp", "4"], "-tp"),  # the CEL rule's Python twin names it, and so would the parser check
    (["--po", "9000"], "unrecognized arguments: --po"),
])
def test_engine_args_bypass_refused(objects, run_operator, args, expect):
    """Item 1 (#20), the steps that showed it: `-tp 4` gave a StatefulSet running
    `--tensor-parallel-size 1 -tp 4` on one GPU, `--po 9000` a port the probes do not check.
    A server with CEL refuses -tp itself; on this 1.20 server the operator refuses both:
    Ready=False InvalidSpec with the reason, and no StatefulSet."""
    run_operator()
    try:
        objects.create_llmd("args", {**SPEC, "engine": {"args": args}})
    except ApiException as e:
        assert e.status == 422 and "engine.args may not set" in e.body
        return
    cr = wait_for(lambda: cond(c := objects.llmd("args"), "Ready").get("reason") == "InvalidSpec" and c, 30,
                  what="Ready=False InvalidSpec", show=lambda: objects.llmd("args").get("status"))
    assert expect in cond(cr, "Ready")["message"], cond(cr, "Ready")["message"]
    assert objects.get("apps/v1", "statefulsets", "args") is None
