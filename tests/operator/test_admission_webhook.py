"""Issue 58, item 3: a spec the operator will refuse is refused at admission, by a
validating webhook the operator serves, with the reconciler's own message. The API server on
loopback calls the operator on 127.0.0.1 over HTTPS (a certificate made here, as the chart
makes one in a cluster); kopf keeps the ValidatingWebhookConfiguration for the test.

With the webhook off (every other test), the reconciler's checks still report such a spec
(test_operator_validation.test_engine_args_bypass_refused)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

import k8s_cluster
from kvship_operator import spec as s
from kvship_operator import validate
from kvship_operator.schema import SpecError
from kvship_operator.webhook import HANDLER_ID, Webhook
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from test_operator_cluster import cond

GOOD = {"model": {"hub": "a/b"}, "gpu": {"count": 0}, "replicas": 1}
BAD_ARGS = {**GOOD, "engine": {"args": ["--po", "9000"]}}


def serving_cert(d: Path) -> None:
    """A CA and a serving certificate for 127.0.0.1, in the files the chart's Secret holds."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=kvship-webhook-test-ca")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt",
            "-days", "2", "-extfile", "ext")


def reconciler_message(name: str, spec: dict) -> str:
    """What the reconciler writes into Ready=False/InvalidSpec for this object."""
    try:
        validate.valid_spec({"metadata": {"name": name}, "spec": spec})
    except SpecError as e:
        return f"invalid spec: {e}"
    raise AssertionError("the spec is valid")


def refusal(e: ApiException) -> str:
    return json.loads(e.body)["message"]


@pytest.mark.timeout(120)
def test_bad_spec_refused_at_admission_with_the_reconcilers_message(objects, run_operator, tmp_path):
    """The steps that showed it: `engine.args: ["--po", "9000"]` was created, then reported
    as Ready=False/InvalidSpec: GitOps tools showed it as applied."""
    serving_cert(tmp_path)
    managed = f"{objects.ns}.kvship.io"
    hook = Webhook(port=k8s_cluster.free_port(), addr="127.0.0.1", host="127.0.0.1", cert_dir=str(tmp_path),
                   managed=managed)
    path = f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{managed}"
    op = None
    try:
        op = run_operator(webhook=hook)
        config = wait_for(lambda: (c := objects._call("GET", path)).get("webhooks") and c, 30,
                          what="the ValidatingWebhookConfiguration")
        (w,) = config["webhooks"]
        assert w["clientConfig"]["url"] == f"https://127.0.0.1:{hook.port}/{HANDLER_ID}"
        assert w["failurePolicy"] == "Ignore" and w["rules"][0]["operations"] == ["CREATE", "UPDATE"]

        # the API server may take a moment to pick the configuration up (and lets writes
        # through while the webhook cannot answer): wait for a first refusal on a throw-away name
        def refused(name: str, spec: dict) -> str | None:
            try:
                objects.create_llmd(name, spec)
            except ApiException as e:
                return refusal(e) if e.status == 422 else None
            objects.delete_llmd(name)
            return None

        wait_for(lambda: refused("probe", BAD_ARGS), 30, what="the webhook in force")

        with pytest.raises(ApiException) as e:
            objects.create_llmd("args", BAD_ARGS)
        assert e.value.status == 422
        message = refusal(e.value)
        want = reconciler_message("args", BAD_ARGS)
        assert want in message and "unrecognized arguments: --po" in want, message
        assert objects.llmd("args") is None  # nothing stored

        # a good spec is admitted and reconciled; a bad change of it is refused, a good one is not
        objects.create_llmd("good", GOOD)
        wait_for(lambda: cond(objects.llmd("good"), "Synced").get("status") == "True", 30, what="reconciled")
        with pytest.raises(ApiException) as e:
            objects.patch_llmd_spec("good", {"engine": {"args": ["-tp", "4"]}})
        assert e.value.status == 422 and reconciler_message("good", {**GOOD, "engine": {"args": ["-tp", "4"]}}) \
            in refusal(e.value), refusal(e.value)
        assert objects.llmd("good")["spec"].get("engine", {}).get("args") in (None, [])
        objects.patch_llmd_spec("good", {"engine": {"args": ["--max-num-seqs", "4"]}})
        # writes that leave the spec alone (labels; kopf's own annotations) always pass
        objects._call("PATCH", f"/apis/{s.API_VERSION}/namespaces/{objects.ns}/{s.PLURAL}/good",
                      {"metadata": {"labels": {"team": "a"}}}, "application/merge-patch+json")
        wait_for(lambda: (c := objects.llmd("good"))["status"].get("observedGeneration") == c["metadata"][
            "generation"] and cond(c, "Synced").get("status") == "True", 30, what="the good change reconciled")
    finally:
        if op is not None:
            op.stop()  # kopf takes its webhook out of the configuration as it stops
        try:
            objects._call("DELETE", path)
        except ApiException:
            pass


def test_review_refuses_what_the_reconciler_refuses():
    """The webhook's decision on its own: the reconciler's check and message; an update that
    leaves the spec alone passes (an object stored before the webhook stays writable)."""
    import kopf

    from kvship_operator import webhook

    bad = {"metadata": {"name": "x"}, "spec": BAD_ARGS}
    with pytest.raises(kopf.AdmissionError) as e:
        webhook.review(bad, None, "CREATE")
    assert str(e.value) == reconciler_message("x", BAD_ARGS) and e.value.code == 422
    webhook.review({"metadata": {"name": "x"}, "spec": GOOD}, None, "CREATE")
    webhook.review(bad, {"metadata": {"name": "x"}, "spec": BAD_ARGS}, "UPDATE")  # labels, status, annotations
    with pytest.raises(kopf.AdmissionError):
        webhook.review(bad, {"metadata": {"name": "x"}, "spec": GOOD}, "UPDATE")
    with pytest.raises(kopf.AdmissionError, match="name"):  # the name check, with the server's five characters
        webhook.review({"metadata": {"generateName": "a" * 60}, "spec": GOOD}, None, "CREATE")
    webhook.review({"metadata": {"generateName": "llama-"}, "spec": GOOD}, None, "CREATE")


@pytest.mark.parametrize("spec, expect", [
    ({**GOOD, "replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}},
     "spec: autoscaling.minReplicas 0 (scale from zero) needs routing.mode envoy or gateway"),
    ({**GOOD, "routing": {"mode": "gateway"},
      "autoscaling": {"enabled": True, "provider": "hpa", "minReplicas": 0, "maxReplicas": 2}},
     "spec: autoscaling.provider hpa cannot scale to zero"),
    ({**GOOD, "routing": {"mode": "nginx"}},
     "spec.routing.mode: Unsupported value 'nginx': supported values: 'service', 'envoy', 'gateway'"),
    ({**GOOD, "routing": {"mode": "envoy", "loadBoundPercent": -1}},
     "spec.routing.loadBoundPercent: should be greater than or equal to 0"),
    ({**GOOD, "routing": {"mode": "gateway"}, "engine": {"args": ["--kv-events-config", "{}"]}},
     "spec.engine.args: may not set --kv-events-config: it comes from spec.routing.kvEvents"),
])
def test_review_refuses_bad_routing_specs(spec, expect):
    """Issue 51: a routing or scale-from-zero spec the operator cannot act on is refused at
    admission with the reconciler's message, which names the field and the way out."""
    import kopf

    from kvship_operator import webhook

    with pytest.raises(kopf.AdmissionError) as e:
        webhook.review({"metadata": {"name": "x"}, "spec": spec}, None, "CREATE")
    assert str(e.value) == reconciler_message("x", spec) and expect in str(e.value), str(e.value)
    fixed = {**spec, "routing": {"mode": "envoy", "kvEvents": False},
             "autoscaling": {**spec.get("autoscaling", {}), "provider": "builtin"}}
    webhook.review({"metadata": {"name": "x"}, "spec": fixed}, None, "CREATE")
