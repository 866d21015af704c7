"""Property-based fuzz of the HTTP API from its own published /openapi.json (schemathesis
generates the requests, hypothesis drives them): whatever comes in, no 5xx, every error in
OpenAI's shape, and the server still answers correctly afterwards. Bounded to well under two
minutes: a fixed number of examples per operation, and generation kept to a few tokens."""
from __future__ import annotations

import itertools
import json
import time
import urllib.parse

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server_utils import start_server

EXAMPLES = 30  # per operation and mode
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("GET", "/v1/models/{model_id}"), ("GET", "/v1/models")]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "96", "--kv-cache-memory", "256MiB", "--max-num-seqs", "4",
                       "--shutdown-timeout", "5")
    yield srv
    assert srv.stop() == 0, srv.log()


def bounded(body: object) -> object:
    """Keep what the engine generates tiny: the fuzz is about the request path, not decoding."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 4:
                body[key] = 4
        for key in ("max_tokens", "max_output_tokens"):  # the second is the Responses API's
            if not isinstance(body.get(key), int):
                body.setdefault(key, 4)
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


# ---------------------------------------------------------------- every string field, hostile text

SIMPLE_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (method, path, a valid body, the string fields in it: a path of keys and indexes). A field's
# value is replaced by hostile text; None as the last step appends the text to a list.
STRING_FIELDS: list[tuple[str, str, dict, list[tuple]]] = [
    ("POST", "/v1/chat/completions", {**SIMPLE_CHAT, "stop": ["x"], "user": "u"}, [
        ("model",), ("messages", 0, "content"), ("messages", 0, "name"), ("stop", 0), ("stop",), ("user",),
        ("vendor_field",), ("chat_template_kwargs", "k")]),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                      "max_tokens": 2}, [("messages", 0, "content", 0, "text")]),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                                   {"role": "tool", "tool_call_id": "c1", "content": "r"}],
                                      "tools": [TOOL], "tool_choice": "none", "max_tokens": 2}, [
        ("messages", 0, "content"), ("messages", 2, "tool_calls", 0, "id"),
        ("messages", 2, "tool_calls", 0, "function", "arguments"), ("messages", 2, "tool_calls", 0, "function", "name"),
        ("messages", 3, "tool_call_id"), ("messages", 3, "content"), ("tools", 0, "function", "description"),
        ("tools", 0, "function", "name"), ("tool_choice",)]),
    ("POST", "/v1/chat/completions", {**SIMPLE_CHAT, "messages": [{"role": "user", "content": "q"},
                                                                  {"role": "assistant", "content": "a"}],
                                      "continue_final_message": True, "add_generation_prompt": False},
     [("messages", 1, "content")]),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": "x", "user": "u"}, [
        ("model",), ("prompt",), ("stop",), ("user",), ("suffix",)]),
    ("POST", "/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 2, "echo": True}, [("prompt", 1)]),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "instructions": "i", "user": "u",
                               "metadata": {"k": "v"}}, [
        ("model",), ("input",), ("instructions",), ("user",), ("metadata", "k"), ("previous_response_id",)]),
    ("POST", "/v1/responses", {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                         "text": "hi"}]},
                                         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                         {"type": "function_call_output", "call_id": "c1", "output": "r"}],
                               "tools": [{"type": "function", "name": "f", "description": "d"}],
                               "max_output_tokens": 2}, [
        ("input", 0, "content", 0, "text"), ("input", 1, "call_id"), ("input", 1, "name"), ("input", 1, "arguments"),
        ("input", 2, "output"), ("input", 2, "call_id"), ("tools", 0, "description"), ("tools", 0, "name")]),
    ("POST", "/v1/embeddings", {"input": ["hi"]}, [("model",), ("input",), ("input", 0), ("user",)]),
    ("POST", "/tokenize", {"prompt": "hi"}, [("model",), ("prompt",)]),
    ("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, [("messages", 0, "content")]),
    ("POST", "/detokenize", {"tokens": [1, 2]}, [("model",)]),
    ("GET", "/v1/models/{}", {}, [("path",)]),
]
CASES = [(method, path, body, field) for method, path, body, fields in STRING_FIELDS for field in fields]

HOSTILE = [
    "\ud800", "a\udfffb", "\udbff\udbff",  # lone surrogates (sent as JSON escapes)
    "\x00", "nul\x00in\x00the\x00middle", "".join(map(chr, range(32))) + "\x7f\x85",  # control characters
    "\u202e\u2028\u2029\ufeff\ufffe\uffff\U0010ffff",  # direction marks, separators, noncharacters
    "{{ 7 * 7 }}{% for x in y %}", '"}\\', "a" * 200_000, "\u00e9" * 50_000 + "\ud83d",  # template, JSON, overlong
]


def with_value(body: dict, field: tuple, value: str) -> dict:
    body = json.loads(json.dumps(body))
    target = body
    for key in field[:-1]:
        target = target.setdefault(key, {}) if isinstance(target, dict) else target[key]
    target[field[-1]] = value
    return body


def send_hostile(client: httpx.Client, method: str, path: str, body: dict, field: tuple, value: str) -> httpx.Response:
    if method == "GET":
        return client.get(path.format(urllib.parse.quote(value.encode("utf-8", "surrogatepass"))[:4000]))
    raw = json.dumps(with_value(body, field, value))  # ensure_ascii: a lone surrogate goes out as its escape
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def test_hostile_text_in_every_string_field(server):
    """Every string field of every endpoint, with each kind of hostile text: never a 5xx."""
    started = time.monotonic()
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for (method, path, body, field), value in itertools.product(CASES, HOSTILE):
            r = send_hostile(client, method, path, body, field, value)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert_sane(r, f"{method} {path} {field} {value[:40]!r}")
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both answers were reached
    assert time.monotonic() - started < 240


HOSTILE_TEXT = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=()), max_size=40),  # any code point, surrogates included
    st.text(st.characters(categories=("Cc", "Cf", "Cs", "Co", "Zl", "Zp")), min_size=1, max_size=20),
    st.builds(lambda c, n: c * n, st.sampled_from(["a", "\x00", "\ud800", "\u00e9", " "]),
              st.integers(1_000, 300_000)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          phases=[Phase.generate])
@given(case=st.sampled_from(CASES), value=HOSTILE_TEXT)
def test_random_hostile_text_in_string_fields(server, case, value):
    method, path, body, field = case
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert_sane(send_hostile(client, method, path, body, field, value), f"{method} {path} {field} {value[:40]!r}")
