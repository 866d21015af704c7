"""LoRA adapters over the API of a real `kvship serve`, through the official openai client: the
request's model picks the adapter (greedy tokens equal transformers on the merged weights),
/v1/models lists adapters with their parent, adapters load and unload at run time (a request
in flight keeps its adapter), 404/400 cases, and the LoRA metrics."""
import httpx
import openai
import pytest

from conftest import make_tiny_model
from lora_adapters import greedy, make_adapter
from server_utils import assert_error, start_server

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-api")
    base = make_tiny_model(root / "base", "llama-gqa-tied")
    merged = {"r4": make_adapter(root / "r4", base, rank=4, alpha=8, seed=1),
              "r8": make_adapter(root / "r8", base, rank=8, alpha=8, seed=2, targets=("q_proj", "down_proj"))}
    make_adapter(root / "r32", base, rank=32, alpha=32, seed=3)
    make_adapter(root / "head", base, rank=4, alpha=4, seed=4, targets=("q_proj", "lm_head"))
    server = start_server(str(root / "base"), "--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", "128", "--num-kv-blocks", "128", "--enable-lora", "--max-loras", "2",
                          "--lora-modules", f"r4={root / 'r4'}", "--allow-runtime-lora-updating")
    yield server, root, base, merged
    server.stop()


def _tokens(client, model: str, max_tokens: int = 6) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return [int(t.removeprefix("t")) if t != "</s>" else 319 for t in out.choices[0].logprobs.tokens]


@pytest.mark.timeout(300)
def test_adapters_by_model_name(lora_server):
    server, root, base, merged = lora_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "r4"} and models["r4"].parent == "tiny" and models["tiny"].parent is None
    assert client.models.retrieve("r4").parent == "tiny"
    assert _tokens(client, "r4") == greedy(merged["r4"], PROMPT, 6)
    assert _tokens(client, "tiny") == greedy(base, PROMPT, 6)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="r8", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"

    load = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "r8", "lora_path": str(root / "r8")})
    assert load.status_code == 200, load.text
    assert {m.id for m in client.models.list().data} == {"tiny", "r4", "r8"}
    assert _tokens(client, "r8", 3) == greedy(merged["r8"], PROMPT, 3)
    want = greedy(merged["r8"], PROMPT, 24)
    stream = client.completions.create(model="r8", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = []
    for i, chunk in enumerate(stream):
        if i == 0:  # unloaded while the request runs: it finishes with the adapter it started with
            assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "r8"}).status_code == 200
        if chunk.choices and chunk.choices[0].logprobs:
            got += [int(t.removeprefix("t")) if t != "</s>" else 319 for t in chunk.choices[0].logprobs.tokens]
    assert got == want
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="r8", prompt=PROMPT, max_tokens=2)

    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvship:lora_requests_total{lora_name="r4",model_name="tiny"} 1.0' in metrics
    assert 'kvship:lora_requests_total{lora_name="r8",model_name="tiny"} 2.0' in metrics
    info = next(line for line in metrics.splitlines() if line.startswith("kvship:lora_requests_info{"))
    assert 'max_lora="2"' in info and 'running_lora_adapters=""' in info


def test_bad_adapters_are_refused(lora_server):
    server, root, _, _ = lora_server
    url = server.url + "/v1/load_lora_adapter"
    err = assert_error(httpx.post(url, json={"lora_name": "big", "lora_path": str(root / "r32")}), 400, "lora_path")
    assert "r=32" in err["message"] and "--max-lora-rank 16" in err["message"]
    err = assert_error(httpx.post(url, json={"lora_name": "head", "lora_path": str(root / "head")}), 400, "lora_path")
    assert "lm_head" in err["message"]
    assert_error(httpx.post(url, json={"lora_name": "gone", "lora_path": str(root / "missing")}), 404, "lora_path")
    assert_error(httpx.post(url, json={"lora_name": "r4", "lora_path": str(root / "r4")}), 400, "lora_name")
    assert_error(httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "lora_name")
    assert {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]} >= {"tiny", "r4"}


def test_lora_modules_spelling():
    from kvship.server.lora import parse_lora_module

    assert parse_lora_module("sql=/a/b=c") == ("sql", "/a/b=c")
    assert parse_lora_module('{"name": "sql", "path": "/a", "base_model_name": "x"}') == ("sql", "/a")
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_module("/just/a/path")
