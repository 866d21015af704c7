"""spec.adapters (issue 52): the plan that brings a replica to the spec, what the pod template
carries (and that adding or removing an adapter leaves it alone: no rollout), the admission
checks, and the sync against a real `kvship serve` loading and unloading adapters."""
from __future__ import annotations

import httpx
import pytest

from conftest import make_tiny_model
from kvship_operator import adapter_sync
from kvship_operator import adapters as ad
from kvship_operator import builders as b
from kvship_operator import spec as s
from kvship_operator.schema import SpecError, parse
from kvship_operator.validate import valid_spec
from lora_adapters import make_adapter
from server_utils import start_server

OWNER = b.Owner("qwen", "team-a", "uid-123")
SQL = {"name": "sql", "source": {"hub": "org/sql-lora"}}
FR = {"name": "fr", "source": {"pvc": {"claimName": "loras", "path": "/fr/v2"}}}
WEB = {"name": "web", "source": {"url": "https://x.example/loras/web"}}


def _spec(*adapters, **extra):
    return parse(s.LLMDeploymentSpec, {"model": {"hub": "Qwen/Qwen3-0.6B"}, "adapters": list(adapters), **extra})


def _template(spec):
    return b.statefulset(OWNER, spec)["spec"]["template"]


def _engine(spec):
    return _template(spec)["spec"]["containers"][0]


def test_plan_loads_missing_unloads_removed_and_reloads_a_changed_source():
    assert not ad.plan({"a": "/x"}, {"a": "/x"})
    p = ad.plan({"a": "/x", "b": "org/b", "c": "/new"}, {"a": "/x", "c": "/old", "gone": "/g"})
    assert p.unload == ["c", "gone"]
    assert p.load == [("b", "org/b"), ("c", "/new")]
    assert ad.plan({}, {"a": "/x"}).unload == ["a"]


def test_held_reads_adapter_cards_only():
    cards = [{"id": "base", "root": "/models/x", "parent": None}, {"id": "sql", "root": "org/sql", "parent": "base"}]
    assert ad.held(cards) == {"sql": "org/sql"}


def test_paths_flags_and_mounts():
    spec = _spec(SQL, FR, WEB)
    assert ad.desired(spec) == {"sql": "org/sql-lora", "fr": "/adapters/loras/fr/v2", "web": "https://x.example/loras/web"}
    c = _engine(spec)
    args = c["args"]
    assert args[args.index("--enable-lora"):][:4] == ["--enable-lora", "--allow-runtime-lora-updating",
                                                        "--max-loras", "4"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "0" and env["HF_HUB_CACHE"] == ad.HUB_CACHE
    assert {"name": "adapters-0", "mountPath": "/adapters/loras", "readOnly": True} in c["volumeMounts"]
    assert {"name": "adapters-0", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}} \
        in _template(spec)["spec"]["volumes"]
    plain = _engine(_spec())
    assert "--enable-lora" not in plain["args"]
    assert {e["name"]: e.get("value") for e in plain["env"]}["HF_HUB_OFFLINE"] == "1"


def test_max_loras_sized_from_the_list_or_set_in_engine_args():
    assert [ad.max_loras(n) for n in (1, 4, 5, 9, 33)] == [4, 4, 8, 16, 64]
    args = _engine(_spec(SQL, engine={"args": ["--max-loras", "2", "--max-lora-rank", "64"]}))["args"]
    assert args.count("--max-loras") == 1 and args[args.index("--max-loras") + 1] == "2"


def test_adding_or_removing_an_adapter_keeps_the_pod_template():
    """No rollout: what replicas hold changes through the API, not through their template."""
    one = _template(_spec(SQL, FR))
    assert _template(_spec(SQL, FR, WEB)) == one  # added (hub/url, or on a claim already mounted)
    assert _template(_spec(FR, {"name": "fr2", "source": {"pvc": {"claimName": "loras", "path": "fr3"}}})) == one
    assert _template(_spec(FR, {"name": "b", "source": {"hub": "o/b"}})) == one  # one removed, one added
    assert _template(_spec(FR)) == one
    assert _template(_spec(SQL)) != one  # no adapter left on the claim: it is unmounted
    assert _template(_spec()) != one  # the last one: no --enable-lora


@pytest.mark.parametrize("spec, where, words", [
    ({"adapters": [SQL, {**SQL, "source": {"url": "https://x/y"}}]}, "spec", "names must be unique"),
    ({"adapters": [{"name": "Qwen/Qwen3-0.6B", "source": {"hub": "o/x"}}]}, "spec.adapters[0].name",
     "is the served model name"),
    ({"servedModelName": "chat", "adapters": [{"name": "chat", "source": {"hub": "o/x"}}]}, "spec.adapters[0].name",
     "is the served model name"),
    ({"adapters": [{"name": "x", "source": {"hub": "o/x", "url": "https://x/y"}}]}, "spec.adapters[0].source",
     "exactly one of hub, url, pvc"),
    ({"adapters": [{"name": "x", "source": {"url": "ftp://x/y"}}]}, "spec.adapters[0].source.url", "should match"),
    ({"adapters": [{"name": "x", "source": {"pvc": {"claimName": "c", "path": "../other"}}}]},
     "spec.adapters[0].source", "may not contain '..'"),
    ({"adapters": [SQL], "engine": {"args": ["--lora-modules", "a=/a"]}}, "spec.engine.args", "spec.adapters"),
])
def test_bad_adapters_refused_with_a_clear_message(spec, where, words):
    cr = {"metadata": {"name": "qwen"}, "spec": {"model": {"hub": "Qwen/Qwen3-0.6B"}, **spec}}
    with pytest.raises(SpecError) as e:
        valid_spec(cr)
    assert e.value.path.startswith(where) and words in str(e.value), e.value


def test_lora_modules_allowed_without_spec_adapters():
    valid_spec({"metadata": {"name": "qwen"}, "spec": {"model": {"hub": "a/b"}, "engine": {
        "args": ["--enable-lora", "--lora-modules", "a=/a"]}}})


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-operator")
    base = make_tiny_model(root / "base", "llama-gqa-tied")
    for i, name in enumerate(("a", "b", "c")):
        make_adapter(root / name, base, rank=4, alpha=8, seed=i + 1)
    make_adapter(root / "wide", base, rank=32, alpha=32, seed=9)
    server = start_server(str(root / "base"), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", "128", "--num-kv-blocks", "64", "--enable-lora", "--max-loras", "2",
                          "--allow-runtime-lora-updating")
    yield server, root
    server.stop()


def _pod(name):
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.mark.timeout(300)
def test_sync_loads_and_unloads_a_real_engine_to_match_the_spec(lora_engine):
    server, root = lora_engine
    address = server.url.removeprefix("http://")
    pods = [_pod("qwen-0"), {"metadata": {"name": "qwen-1"}, "status": {}}]  # qwen-1 is not ready: left alone

    def models():
        return {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}

    want = {"a": str(root / "a"), "b": str(root / "b")}
    assert adapter_sync.sync(pods, want, lambda p: address) == [{"replica": "qwen-0", "adapters": ["a", "b"]}]
    assert {k: m["parent"] for k, m in models().items()} == {"tiny": None, "a": "tiny", "b": "tiny"}
    # b dropped, c added, a's source changed (reloaded), and one the engine refuses (rank 32 > 16)
    want = {"a": str(root / "c"), "c": str(root / "c"), "wide": str(root / "wide")}
    [replica] = adapter_sync.sync(pods, want, lambda p: address)
    assert replica["adapters"] == ["a", "c"]
    assert "load wide from" in replica["message"] and "rank" in replica["message"], replica
    held = models()
    assert set(held) == {"tiny", "a", "c"} and held["a"]["root"] == str(root / "c")
    out = httpx.post(server.url + "/v1/completions", json={"model": "c", "prompt": [3, 14, 15], "max_tokens": 2})
    assert out.status_code == 200 and out.json()["model"] == "c", out.text
    assert adapter_sync.sync(pods, {}, lambda p: address) == [{"replica": "qwen-0", "adapters": []}]
    assert set(models()) == {"tiny"}


def test_sync_reports_an_unreachable_replica():
    [replica] = adapter_sync.sync([_pod("qwen-0")], {"a": "/a"}, lambda p: "127.0.0.1:9")
    assert replica["replica"] == "qwen-0" and replica["adapters"] == [] and "127.0.0.1:9" in replica["message"]
