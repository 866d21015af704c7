"""spec.adapters end to end (issue 52): the operator against the real API server, a real
`kvship serve` (tiny model, --enable-lora) standing in for the replica through the operator's
pod-address resolver, adapters served over http (url sources). Adding and removing adapters in
the spec loads and unloads them in the running engine, status.adapters follows, and the
StatefulSet is left alone (no rollout). No kubelet runs: the test marks the pod Ready."""
from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from conftest import make_tiny_model
from lora_adapters import make_adapter
from operator_fixtures import api, cluster, crd_installed, namespace, objects, run_operator  # noqa: F401 (fixtures)
from operator_helpers import wait_for
from server_utils import start_server
from test_operator_cluster import running_ready

NAME = "lora"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def engine_and_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-cluster")
    base = make_tiny_model(root / "base", "llama-gqa-tied")
    for i, name in enumerate(("a", "b")):
        make_adapter(root / "files" / name, base, rank=4, alpha=8, seed=i + 1)
    files = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root / "files")))
    thread = threading.Thread(target=files.serve_forever, daemon=True)
    thread.start()
    server = start_server(str(root / "base"), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", "128", "--num-kv-blocks", "32", "--enable-lora",
                          "--allow-runtime-lora-updating")
    yield server, f"http://127.0.0.1:{files.server_address[1]}"
    server.stop()
    files.shutdown()
    files.server_close()
    thread.join(5)


@pytest.mark.timeout(300)
def test_adapters_follow_the_spec_without_a_rollout(objects, run_operator, engine_and_files):
    server, files = engine_and_files
    address = server.url.removeprefix("http://")
    run_operator(pod_address=lambda pod: address if pod["metadata"]["namespace"] == objects.ns else None)

    def adapter(name, folder=None):
        return {"name": name, "source": {"url": f"{files}/{folder or name}"}}

    def held_by_status():
        return (objects.llmd(NAME).get("status") or {}).get("adapters")

    def engine_holds():
        return {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"] if m.get("parent")}

    objects.create_llmd(NAME, {"model": {"pvc": {"claimName": "models"}}, "servedModelName": "tiny",
                               "gpu": {"count": 0}, "modelCache": {"enabled": False}, "adapters": [adapter("a")]})
    pod = wait_for(lambda: objects.get("v1", "pods", f"{NAME}-0"), 30, what="pod lora-0")
    args = pod["spec"]["containers"][0]["args"]
    assert "--enable-lora" in args and "--allow-runtime-lora-updating" in args
    objects.patch_pod_status(f"{NAME}-0", running_ready(f"{NAME}-0"))
    wait_for(lambda: held_by_status() == [{"replica": f"{NAME}-0", "adapters": ["a"]}], 60, what="a loaded",
             show=held_by_status)
    assert engine_holds() == {"a"}
    sts = objects.get("apps/v1", "statefulsets", NAME)

    objects.patch_llmd_spec(NAME, {"adapters": [adapter("a"), adapter("b")]})
    wait_for(lambda: held_by_status() == [{"replica": f"{NAME}-0", "adapters": ["a", "b"]}], 60, what="b loaded",
             show=held_by_status)
    assert engine_holds() == {"a", "b"}
    out = httpx.post(server.url + "/v1/completions", json={"model": "b", "prompt": [3, 14, 15], "max_tokens": 2})
    assert out.status_code == 200, out.text

    # a removed, and one whose source is not there: reported, the rest still applied
    objects.patch_llmd_spec(NAME, {"adapters": [adapter("b"), adapter("c", "missing")]})
    st = wait_for(lambda: (h := held_by_status()) and h[0]["adapters"] == ["b"] and h[0].get("message") and h, 60,
                  what="a unloaded, c reported", show=held_by_status)
    assert "load c from" in st[0]["message"], st
    assert engine_holds() == {"b"}

    after = objects.get("apps/v1", "statefulsets", NAME)
    assert after["metadata"]["generation"] == sts["metadata"]["generation"]
    assert after["spec"]["template"] == sts["spec"]["template"]
    assert objects.get("v1", "pods", f"{NAME}-0")["metadata"]["uid"] == pod["metadata"]["uid"]
