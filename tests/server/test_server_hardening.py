"""The server as a hostile client meets it: every bad input is an OpenAI-shaped 4xx naming its
`param` (never a 5xx), connections survive errors, requests are bounded. A real `kvship serve`
with the bundled SmolLM2 on CPU; the inputs are the ones that broke it."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from server_utils import assert_error, free_port, start_server

MAX_MODEL_LEN = 512
MAX_WAITING = 8
MAX_BODY = 16 * 2**20
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "1GiB", "--shutdown-timeout", "5",
                       "--max-waiting-requests", str(MAX_WAITING), "--max-request-body-size", str(MAX_BODY))
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()


def post_raw(url: str, path: str, content: bytes | str, **kw) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


# ------------------------------------------------------------------ 1: no 500 from input

# JSON text with the escape itself: json.dumps would escape the backslash instead.
LONE_SURROGATE = '"\\ud800x"'


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}', "messages[0].content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
         "messages[0].content[0].text"),
        ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["hi", %s], "max_tokens": 2}', "prompt[1]"),
        ("/tokenize", '{"prompt": %s}', "prompt"),
        ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
    ],
)
def test_lone_surrogate_is_400(server, path, raw, param):
    err = assert_error(post_raw(server.url, path, raw % LONE_SURROGATE), 400, param)
    assert err["type"] == "invalid_request_error" and "surrogate" in err["message"]


@pytest.mark.parametrize("seed", [2**70, -(2**63) - 1, 2**63])
@pytest.mark.parametrize("stream", [False, True])
def test_seed_outside_int64_is_400(server, seed, stream):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "hi"})):
        body = {**body, "max_tokens": 2, "seed": seed, "stream": stream}
        assert_error(httpx.post(server.url + path, json=body, timeout=60), 400, "seed")


def test_seed_at_the_int64_bounds_is_accepted(server):
    for seed in (2**63 - 1, -(2**63)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": seed, "n": 2},
                       timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw",
    [
        "[" * 100_000,
        '{"a":' * 5_000 + "1" + "}" * 5_000,
        '{"prompt": "hi", "vendor": ' + '{"a":' * 5_000 + "1" + "}" * 5_000 + "}",
        '{"messages": [{"role": "user", "content": "hi"}], "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ],
)
def test_deeply_nested_json_is_400(server, raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        err = assert_error(post_raw(server.url, path, raw), 400)
        assert err["code"] == "invalid_json"


# ------------------------------------------------------------------ 2: connections survive errors


def exchange(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request and its response on an open keep-alive connection."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response to {method} {path}"
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of a response"
        rest += chunk
    return status, headers, rest[:length]


def test_keep_alive_connection_survives_refused_inputs(server):
    bad = [
        b'{"messages": [{"role": "user", "content": "\\ud800x"}]}',
        json.dumps({"messages": QUESTION, "seed": 2**70, "stream": True}).encode(),
        b"[" * 100_000,
        b"not json",
    ]
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        for body in bad:
            status, headers, payload = exchange(sock, "POST", "/v1/chat/completions", body)
            assert status == 400 and headers.get("connection") != "close", (status, payload)
            assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}
        good = json.dumps({"messages": QUESTION, "max_tokens": 2}).encode()
        status, _, payload = exchange(sock, "POST", "/v1/chat/completions", good)
        assert status == 200 and json.loads(payload)["object"] == "chat.completion"


def test_a_500_leaves_the_connection_usable():
    """An exception no handler knows (a bug, not an input) is an OpenAI-shaped 500, and the
    client's next request on the same connection is answered. In process, because no input
    reaches a 500 in the real server any more."""
    import uvicorn

    from kvship.config import EngineConfig
    from kvship.server.app import build_app

    app = build_app(None, EngineConfig(), chat_page=False)

    @app.get("/boom")
    async def boom() -> None:
        raise TypeError("a bug")

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off"))
    thread = threading.Thread(target=srv.run, name="uvicorn-test")
    thread.start()
    try:
        for _ in range(200):
            if srv.started:
                break
            threading.Event().wait(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            status, _, payload = exchange(sock, "GET", "/boom")
            assert status == 500
            assert json.loads(payload)["error"]["type"] == "server_error"
            status, _, payload = exchange(sock, "GET", "/health")
            assert status == 503 and json.loads(payload) == {"status": "loading"}
    finally:
        srv.should_exit = True
        thread.join(30)


# ------------------------------------------------------------------ 5: values that were accepted and wrong

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_non_finite_numbers_are_400(server, field, literal):
    raw = '{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field, literal)
    assert_error(post_raw(server.url, "/v1/completions", raw), 400, field)


def test_non_finite_number_on_chat_stream_is_400(server):
    raw = '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN, "stream": true}'
    assert_error(post_raw(server.url, "/v1/chat/completions", raw), 400, "temperature")


@pytest.mark.parametrize("ids", [[49152], [10**6], [-1], [2, 49152]])
def test_stop_token_ids_outside_the_vocabulary_are_400(server, ids):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "stop_token_ids": ids}, timeout=60)
        assert_error(r, 400, "stop_token_ids")


def test_min_tokens_above_max_tokens_is_400(server):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 5, "min_tokens": 10}, timeout=60)
        assert_error(r, 400, "min_tokens")
    # Left open, chat's max_tokens is the context's room: more than that is refused as well.
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "min_tokens": MAX_MODEL_LEN},
                   timeout=60)
    assert_error(r, 400, "min_tokens")


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/chat/completions", "stream", "yes"),
        ("/v1/chat/completions", "stream", 1),
        ("/v1/completions", "stream", "true"),
        ("/v1/chat/completions", "logprobs", "yes"),
        ("/v1/completions", "echo", 1),
        ("/v1/completions", "ignore_eos", "on"),
    ],
)
def test_booleans_are_strict(server, path, field, value):
    body = {"messages": QUESTION} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2, field: value}, timeout=60)
    assert_error(r, 400, field)
    nested = httpx.post(server.url + path, json={**body, "max_tokens": 2, "stream": True,
                                                 "stream_options": {"include_usage": "yes"}}, timeout=60)
    assert_error(nested, 400, "stream_options.include_usage")


# ------------------------------------------------------------------ 6: no feature silently ignored

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/chat/completions", {"functions": [WEATHER_TOOL["function"]]}, "functions"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "!"}, "suffix"),
    ],
)
def test_unimplemented_features_are_refused_by_name(server, path, extra, param):
    body = {"messages": QUESTION} if "chat" in path else {"prompt": "hi"}
    for stream in (False, True):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "stream": stream, **extra}, timeout=60)
        err = assert_error(r, 400, param)
        assert "not supported" in err["message"] and err["code"] == "unsupported_parameter"


def test_values_that_ask_for_nothing_are_accepted(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": QUESTION, "max_tokens": 2, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def token_text(server, token_id: int) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": [token_id]}, timeout=30).json()["prompt"]


def test_logit_bias_forces_a_token(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    forced = 504
    for temperature in (0.0, 0.8):
        r = client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                      max_tokens=4, temperature=temperature, logit_bias={str(forced): 100},
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == token_text(server, forced) * 4


def test_logit_bias_bans_the_greedy_choice(server):
    body = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    banned = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {str(ids[0]): -100}}, timeout=60)
    assert banned.status_code == 200 and banned.json()["choices"][0]["text"] != first
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"messages": QUESTION, "max_tokens": 3, "temperature": 0, "logit_bias": {"504": 100}})
    assert chat.json()["choices"][0]["message"]["content"] == token_text(server, 504) * 3


@pytest.mark.parametrize("bias", [{"504": 101}, {"504": -100.5}, {"49152": 1}, {"-1": 1}, {"abc": 1}, {"504": "x"}])
def test_logit_bias_out_of_range_is_400(server, bias):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": bias}, timeout=60)
    assert_error(r, 400, "ANY")["param"].startswith("logit_bias")
    raw = '{"prompt": "hi", "max_tokens": 2, "logit_bias": {"504": NaN}}'
    assert_error(post_raw(server.url, "/v1/completions", raw), 400, "ANY")["param"].startswith("logit_bias")


# ------------------------------------------------------------------ 4: one request cannot fill the queue


def test_prompts_per_request_are_capped(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["hi"] * 3000, "max_tokens": 1}, timeout=60)
    err = assert_error(r, 400, "prompt")
    assert "at most 256 prompts" in err["message"]
    assert server.metrics()["kvship:num_requests_waiting"] == 0


def test_multi_prompt_request_is_admitted_whole_or_refused_whole(server):
    server.wait_metric("kvship:num_requests_running", lambda v: v == 0)
    before = server.metrics()["kvship:prompt_tokens_total"]
    too_many = {"prompt": [f"Prompt number {i}" for i in range(MAX_WAITING + 1)], "max_tokens": 1}
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={**too_many, "stream": stream}, timeout=60)
        assert assert_error(r, 503)["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
    # Nothing of it reached the engine: no prompt token was processed, nothing waits.
    m = server.metrics()
    assert m["kvship:prompt_tokens_total"] == before and m["kvship:num_requests_waiting"] == 0
    fits = {"prompt": [f"Prompt number {i}" for i in range(MAX_WAITING)], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=fits, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_WAITING, r.text


# ------------------------------------------------------------------ 3: a bounded body, never handled on the event loop


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode()
    err = assert_error(post_raw(server.url, "/v1/completions", big), 413)
    assert err["code"] == "request_too_large" and str(MAX_BODY) in err["message"]

    def chunked():  # no Content-Length: refused while it streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 2**20 + 1):
            yield b"x" * 2**20
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers={"content-type": "application/json"},
                   timeout=60)
    assert_error(r, 413)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_10mb_body_does_not_freeze_the_server(server):
    """While 10 MB bodies are parsed, checked and tokenised, /health answers within a second
    and a running stream keeps producing tokens."""
    text = "All work and no play makes Jack a dull boy. " * (10 * 2**20 // 44 + 1)
    # Encoded up front: serialising them inside the client's event loop would stall the client's
    # own /health probes, not the server's.
    bodies = [(path, json.dumps(b).encode()) for path, b in [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["hi", text], "max_tokens": 1}),
        ("/tokenize", {"prompt": text[: 2 * 2**20]}),
    ]]
    assert all(len(b) >= 10 * 2**20 for _, b in bodies[:3])
    # (Bodies of millions of token ids are not here: decoding JSON holds the interpreter's lock
    # for about 0.3 s per million ids wherever it runs; the body limit is what bounds that.)

    async def run() -> tuple[list[float], list[float], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            gaps: list[float] = []
            started = asyncio.Event()
            done = asyncio.Event()

            async def stream() -> None:
                body = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        now = time.monotonic()
                        if last is not None and started.is_set() and not done.is_set():
                            gaps.append(now - last)
                        last = now
                        if len(gaps) == 0 and last is not None:
                            started.set()

            async def health() -> list[float]:
                await started.wait()
                latencies = []
                while not done.is_set():
                    t = time.monotonic()
                    assert (await c.get("/health", timeout=30)).status_code == 200
                    latencies.append(time.monotonic() - t)
                    await asyncio.sleep(0.1)
                return latencies

            async def big() -> list[httpx.Response]:
                await started.wait()
                try:
                    headers = {"content-type": "application/json"}
                    return list(await asyncio.gather(*(c.post(path, content=b, headers=headers) for path, b in bodies)))
                finally:
                    done.set()

            streamer = asyncio.ensure_future(stream())
            latencies, responses = await asyncio.gather(health(), big())
            await streamer
            return gaps, latencies, responses

    gaps, latencies, responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert codes[:3] == [400, 400, 400] and codes[3] == 200, [r.text[:300] for r in responses]
    for r in responses[:3]:
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert responses[3].json()["count"] > 100_000
    assert latencies and max(latencies) < 1.0, latencies
    # Tokens kept coming while the bodies were handled. (The gap bound is loose: this machine's
    # two cores are shared with the tokenizer's own work and other processes; frozen, the
    # stream stalled for the whole ~10 s the bodies took.)
    assert len(gaps) >= 3 and max(gaps) < 5.0, gaps


def test_prompt_proven_too_long_by_its_length_is_refused_before_tokenising(server):
    # 600 KB of text cannot fit 512 tokens whatever the tokenizer does; tokenising it would take
    # seconds on this CPU, the refusal takes none.
    text = "word " * 120_000
    for path, body, param in (("/v1/completions", {"prompt": text}, "prompt"),
                              ("/v1/completions", {"prompt": ["hi", text]}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages")):
        t = time.monotonic()
        err = assert_error(httpx.post(server.url + path, json=body, timeout=60), 400, param)
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"]
        assert time.monotonic() - t < 2.0


# ------------------------------------------------------------------ 7: endpoints the SDKs call


def test_models_retrieve(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    listed = client.models.list().data[0]
    got = client.models.retrieve(listed.id)
    assert got.id == listed.id == "SmolLM2-135M-Instruct" and got.object == "model"
    assert got.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"
    err = assert_error(httpx.get(server.url + "/v1/models/org/other-model"), 404, "model")
    assert "org/other-model" in err["message"]


# ------------------------------------------------------------------ 8: the published schema is the API


def test_openapi_documents_request_bodies_and_errors(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, fields in (("/v1/chat/completions", "ChatCompletionRequest", {"messages", "logit_bias", "tools"}),
                                ("/v1/completions", "CompletionRequest", {"prompt", "best_of", "echo"}),
                                ("/tokenize", "TokenizeRequest", {"prompt", "messages"}),
                                ("/detokenize", "DetokenizeRequest", {"tokens"})):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert fields <= set(schemas[model]["properties"])
        for status in ("400", "404", "413", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}
        assert "422" not in op["responses"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]["404"]
    assert "HTTPValidationError" not in schemas


# ------------------------------------------------------------------ 9: whatever a request holds, its answer encodes

# Written as JSON text: json.dumps would escape the backslash. Lone surrogates of both halves.
SURROGATES = ["\\udfff", "\\udbff", "ab\\udc80cd"]


@pytest.mark.parametrize("escape", SURROGATES)
@pytest.mark.parametrize(
    "path,raw,param",
    [
        # Strings that only reach an error message, or the response itself.
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ("/v1/completions", '{"model": "%s", "prompt": "hi"}', "model"),
        ("/v1/responses", '{"model": "%s", "input": "hi"}', "model"),
        ("/v1/embeddings", '{"model": "%s", "input": "hi"}', "model"),
        ("/tokenize", '{"model": "%s", "prompt": "hi"}', "model"),
        ("/detokenize", '{"model": "%s", "tokens": [1]}', "model"),
        ("/v1/responses", '{"input": "hi", "previous_response_id": "resp_%s"}', "previous_response_id"),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "metadata": {"k": "%s"}}', "metadata.k"),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "user": "%s"}', "user"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "%s"}]}',
         "messages[0].name"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "%s"]}', "stop[1]"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "vendor_field": {"a": ["%s"]}}', "vendor_field.a[0]"),
    ],
)
def test_lone_surrogate_in_any_field_is_400_naming_it(server, path, raw, param, escape):
    for stream in (False, True):
        body = raw % escape
        if stream and path.startswith("/v1/") and path != "/v1/embeddings":
            body = body[:-1] + ', "stream": true}'
        err = assert_error(post_raw(server.url, path, body), 400, param)
        assert "surrogate" in err["message"]


def test_paired_surrogates_are_text(server):
    """An astral character written as a JSON surrogate pair is ordinary text, not refused."""
    raw = '{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "user": "\\ud83d\\ude00"}'
    r = post_raw(server.url, "/v1/completions", raw)
    assert r.status_code == 200, r.text
    t = post_raw(server.url, "/tokenize", '{"prompt": "\\ud83d\\ude00"}').json()["tokens"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": t}, timeout=60).json()["prompt"] == "\U0001F600"


def test_undecodable_model_id_in_the_path_is_404(server):
    """A path whose percent-escapes are not UTF-8 ends up in the error message: it must encode."""
    for raw in ("%ED%A0%80", "%ff%fe", "a%C0%AFb"):
        err = assert_error(httpx.get(server.url + "/v1/models/" + raw, timeout=30), 404, "model")
        assert err["code"] == "model_not_found"


# ------------------------------------------------------------------ 10: small refusals OpenAI makes


@pytest.mark.parametrize("value", [2.000001, 3, 1e308])
def test_temperature_above_2_is_400(server, value):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})):
        err = assert_error(httpx.post(server.url + path, json={**body, "temperature": value, "max_tokens": 2}
                                      if path != "/v1/responses" else {**body, "temperature": value},
                                      timeout=60), 400, "temperature")
        assert "2" in err["message"]


def test_temperature_2_is_accepted(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "temperature": 2, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
@pytest.mark.parametrize("how", ["null", "absent"])
def test_message_without_content_is_400(server, role, how):
    message = {"role": role, **({"content": None} if how == "null" else {})}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    messages = [{"role": "user", "content": "hi"}, message] if role != "user" else [message]
    index = len(messages) - 1
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        err = assert_error(httpx.post(server.url + path, json={"messages": messages, **extra}, timeout=60), 400,
                           f"messages[{index}].content")
        assert "content" in err["message"]


def test_assistant_message_may_carry_only_tool_calls(server):
    messages = [*QUESTION, {"role": "assistant", "content": None,
                            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "Paris"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("empty", ["", []])
def test_empty_responses_input_names_input(server, empty):
    for extra in ({}, {"instructions": "Be brief."}):
        err = assert_error(httpx.post(server.url + "/v1/responses", json={"input": empty, **extra}, timeout=60), 400,
                           "input")
        assert "messages" not in err["message"]


# ------------------------------------------------------------------ 11: continue_final_message

OPEN_ANSWER = [{"role": "user", "content": "Which city is the capital of France?"},
               {"role": "assistant", "content": "The capital city of France is"}]


def tokens(server, **body) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_continue_final_message_leaves_the_final_message_open(server):
    closed = tokens(server, messages=OPEN_ANSWER, add_generation_prompt=False)
    opened = tokens(server, messages=OPEN_ANSWER, continue_final_message=True)
    assert tokens(server, messages=OPEN_ANSWER, continue_final_message=True, add_generation_prompt=False) == opened
    answer = tokens(server, prompt=OPEN_ANSWER[1]["content"], add_special_tokens=False)
    # The prompt ends with the assistant's words: no end-of-turn after them, no new turn.
    assert opened[-len(answer):] == answer
    assert closed[:len(opened)] == opened and len(closed) > len(opened)


def test_continue_final_message_continues_the_answer(server):
    body = {"messages": OPEN_ANSWER, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in text and not text.lstrip().startswith("The"), text
    # The same prompt as a raw completion gives the same words (greedy).
    opened = tokens(server, messages=OPEN_ANSWER, continue_final_message=True)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": opened, "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.json()["choices"][0]["text"] == text


def test_continue_final_message_with_add_generation_prompt_is_400(server):
    for path, extra in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        body = {"messages": OPEN_ANSWER, "continue_final_message": True, "add_generation_prompt": True, **extra}
        assert_error(httpx.post(server.url + path, json=body, timeout=60), 400, "continue_final_message")


def test_continue_final_message_needs_text_to_continue(server):
    messages = [OPEN_ANSWER[0], {"role": "assistant", "content": ""}]
    body = {"messages": messages, "continue_final_message": True, "max_tokens": 2}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, "messages")
    # no message at all to continue (found by the fuzzer: /tokenize answered 500)
    assert_error(httpx.post(server.url + "/tokenize", json={"messages": [], "continue_final_message": True},
                            timeout=60), 400, "messages")


def test_continue_final_message_through_the_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=OPEN_ANSWER, max_tokens=4,
                                         temperature=0, extra_body={"continue_final_message": True,
                                                                    "add_generation_prompt": False})
    assert "Paris" in out.choices[0].message.content


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32"])
def test_lone_surrogate_in_a_utf16_or_utf32_body_is_400(server, encoding):
    """JSON in UTF-16/32 (which the parser accepts) carries the same escapes in other bytes."""
    for path, raw, param in (("/v1/completions", '{"prompt": "hi", "user": "\\udc01"}', "user"),
                             ("/v1/responses", '{"input": "hi", "metadata": {"k": "x\\ud801"}}', "metadata.k"),
                             ("/tokenize", '{"model": "\\udfff", "prompt": "hi"}', "model")):
        err = assert_error(post_raw(server.url, path, raw.encode(encoding)), 400, param)
        assert "surrogate" in err["message"]
