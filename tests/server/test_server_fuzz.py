"""Property-based fuzz of the HTTP API from its own published /openapi.json (schemathesis
generates the requests, hypothesis drives them): whatever comes in, no 5xx, every error in
OpenAI's shape, and the server still answers correctly afterwards. Bounded to well under two
minutes: a fixed number of examples per operation, and generation kept to a few tokens."""
from __future__ import annotations

import itertools
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server_utils import start_server

EXAMPLES = 30  # per operation and mode
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/v1/models/{model_id}"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "96", "--kv-cache-memory", "256MiB", "--max-num-seqs", "4",
                       "--shutdown-timeout", "5")
    yield srv
    assert srv.stop() == 0, srv.log()


def bounded(body: object) -> object:
    """Keep what the engine generates tiny: the fuzz is about the request path, not decoding."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
                body[key] = 4
        if not isinstance(body.get("max_tokens"), int):
            body.setdefault("max_tokens", 4)
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
    return body


def assert_sane(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (what, err)


def test_fuzz_the_published_api(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    started = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for (method, path), mode in itertools.product(OPERATIONS, schemathesis.GenerationMode):
            # POSITIVE: requests the schema allows (they must work or be refused with a 4xx);
            # NEGATIVE: requests that break it (wrong types, missing fields, out-of-range values).
            if mode is schemathesis.GenerationMode.NEGATIVE and method == "GET":
                continue  # nothing in a GET here can break the schema
            operation = schema[path][method]

            @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy(mode), stream=st.booleans())
            def run(case, stream):
                body = bounded(case.body)
                if isinstance(body, dict) and stream and path.endswith("completions"):
                    body["stream"] = True
                url = case.formatted_path
                if body is schemathesis.core.NOT_SET:
                    payload = {}
                elif isinstance(body, bytes):  # negative mode also sends bodies that are not JSON
                    payload = {"content": body, "headers": {"content-type": "application/json"}}
                else:
                    payload = {"json": body}
                r = client.request(method, url, params=case.query or None, **payload)
                assert_sane(r, f"{method} {url} {str(body)[:300]}")

            run()
    assert time.monotonic() - started < 120
    # Alive and right afterwards.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "What is the capital of France?"}],
                         "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
