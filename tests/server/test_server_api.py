"""The OpenAI-compatible server, end to end: a real `kvship serve` subprocess with the bundled
SmolLM2 on CPU, driven by the official openai SDK and httpx."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from server_utils import FLOAT32_WEIGHTS, assert_error, start_server

MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # streamed answers are compared with non-streamed ones, and concurrent with sequential
    srv = start_server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "1GiB", "--shutdown-timeout", "5",
                       *FLOAT32_WEIGHTS)
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------ basics


def test_health_version_models(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    v = httpx.get(server.url + "/version").json()
    assert isinstance(v["version"], str) and v["version"]
    models = client.models.list()
    assert len(models.data) == 1
    card = models.data[0]
    assert card.object == "model" and card.id == "SmolLM2-135M-Instruct"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == model
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_content_parts_and_system_message(client, model):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in r.choices[0].message.content


def test_max_tokens_length_and_exact_usage(client, model):
    for kwargs in ({"max_tokens": 5}, {"max_completion_tokens": 5}):
        r = client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, extra_body={"ignore_eos": True}, **kwargs
        )
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 5
    # Token-id prompts make prompt_tokens checkable exactly.
    ids = [504, 3575, 282, 4649, 314]  # any in-vocabulary ids
    c = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.prompt_tokens == len(ids)
    assert c.usage.completion_tokens == 6 and c.usage.total_tokens == len(ids) + 6
    assert c.choices[0].finish_reason == "length"


def test_chat_streaming_with_usage(client, model, server):
    ref = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == ref.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finishes == [ref.choices[0].finish_reason]
    # Usage comes last, in a chunk of its own with no choices; earlier chunks carry usage=null.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == ref.usage.model_dump()


def test_chat_stream_wire_format(server, model):
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert "usage" not in first  # only when stream_options.include_usage
    last = json.loads(events[-2])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] in ("stop", "length")


def test_completion_and_streaming(client, model):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens <= 8
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_completion_default_max_tokens_is_16(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_prompt_forms_and_echo(client, model):
    single = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    ids = [504, 3575, 282, 4649, 314]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    many = client.completions.create(
        model=model, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == single.choices[0].text
    many_ids = client.completions.create(model=model, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert [c.text for c in many_ids.choices] == [by_ids.choices[0].text] * 2
    assert many_ids.usage.prompt_tokens == 2 * len(ids)
    echo = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text == "The capital of France is" + single.choices[0].text
    # Streaming echo: the prompt comes in the first chunk of the choice.
    chunks = list(
        client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == echo.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client, model):
    """What evaluation harnesses do: echo the prompt with logprobs to score each of its tokens."""
    ids = [504, 3575, 282, 4649, 314]
    r = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1  # the prompt's tokens, then the completion's
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4) and streamed[0] is None


def test_tokenize_and_detokenize(server, client, model):
    text = "The capital of France is"
    r = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": text}).json()
    assert r["tokens"] == [504, 3575, 282, 4649, 314] and r["count"] == 5 and r["max_model_len"] > 5
    # A chat counts the way /v1/chat/completions bills it.
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages}).json()
    billed = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == billed
    back = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    assert_error(httpx.post(server.url + "/tokenize", json={"model": model}), 400, "prompt")
    assert_error(httpx.post(server.url + "/detokenize", json={"model": model, "tokens": [10**9]}), 400, "tokens")
    assert_error(httpx.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_n_2(client, model):
    r = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, n=2, temperature=1.0, seed=7, logprobs=True
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=6, n=2, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = {0: "", 1: ""}
    roles, finishes = set(), {}
    for c in chunks:
        for ch in c.choices:
            if ch.delta.role:
                roles.add(ch.index)
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert roles == {0, 1} and set(finishes) == {0, 1}
    assert chunks[-1].usage.completion_tokens >= 2
    # completions: n per prompt, indices prompt_index * n + i
    c = client.completions.create(model=model, prompt=["a", "b"], max_tokens=3, n=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]


def test_stop(client, model):
    ref = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].message.content
    words = ref.split()
    assert len(words) >= 3, ref
    stop = " " + words[2]
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref[: ref.index(stop)]
    c = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=" 7")
    assert c.choices[0].finish_reason == "stop" and " 7" not in c.choices[0].text


def test_seed_reproducibility(client, model):
    def sample(seed):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10, temperature=1.0, seed=seed
        ).choices[0].message.content

    a, b = sample(1234), sample(1234)
    assert a == b
    others = {sample(s) for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # different seeds sample differently


def test_chat_logprobs_shape(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the sampled token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-4
    no_top = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in no_top.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_logprobs_shape(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 1 <= len(top) <= 4 and tok in top
        assert max(top.values()) == pytest.approx(tlp, abs=1e-4)  # greedy


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/chat/completions", {"messages": QUESTION, "temperature": -0.5}, "temperature"),
        ("/v1/chat/completions", {"messages": QUESTION, "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"messages": QUESTION, "n": 100000}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, "messages"),
        ("/v1/completions", {"prompt": "word " * 600}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "word " * 2000]}, "prompt"),  # tokenized off the event loop
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], "a"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": 7}, "stop"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content"),
    ],
)
def test_invalid_parameters_are_400(server, path, body, param):
    err = assert_error(httpx.post(server.url + path, json=body, timeout=30), 400, param if param else "ANY")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "word " * 600},
        {"prompt": [7] * 600},  # token ids
        {"prompt": [[7, 8], [7] * 600]},
        {"prompt": ["hi", "word " * 600], "stream": True},
        {"prompt": "word " * 600, "max_tokens": None},
    ],
)
def test_over_long_completion_prompt_names_prompt(server, body):
    """/v1/completions has no `messages`: an over-long prompt is reported as `prompt`."""
    err = assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, "prompt")
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_and_non_object_are_400(server):
    for content in (b'{"messages": [', b"not json", b"[1, 2]", b""):
        assert_error(
            httpx.post(server.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"}), 400
        )


def test_json_body_without_json_content_type(server, model):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; the body is JSON all the same.
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_sdk_raises_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="word " * 600)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert e.value.code == "model_not_found"


def test_unknown_model_is_404(server):
    for path, body in (("/v1/chat/completions", {"model": "nope", "messages": QUESTION}), ("/v1/completions", {"model": "nope", "prompt": "x"})):
        err = assert_error(httpx.post(server.url + path, json=body), 404, "model")
        assert err["code"] == "model_not_found"
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_errors_for_streaming_requests_keep_their_status(server, model):
    body = {"model": model, "messages": QUESTION, "temperature": -1, "stream": True}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400, "temperature")


def test_extra_fields_are_ignored(client, model):
    r = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=2, user="u-1", extra_body={"some_vendor_field": {"x": 1}, "top_k": 5}
    )
    assert r.choices[0].message.content is not None


# ------------------------------------------------------------------ disconnects and metrics


def test_metrics_exposed(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvship:num_requests_running", "kvship:num_requests_waiting", "kvship:kv_cache_usage_perc",
                 "kvship:num_kv_blocks_used", "kvship:num_kv_blocks_free"):
        assert f"# TYPE {name} gauge" in text, name
    m = server.metrics()
    assert m["kvship:num_kv_blocks_used"] + m["kvship:num_kv_blocks_free"] == m["kvship:num_kv_blocks"]


def test_cancelled_stream_frees_its_blocks(server, client, model):
    server.wait_metric("kvship:num_kv_blocks_used", lambda v: v == 0)
    long_prompt = "Write a very long essay about the history of Europe. " * 4
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": long_prompt}], max_tokens=300, stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
        if got >= 3:
            break
    during = server.metrics()
    assert during["kvship:num_requests_running"] == 1 and during["kvship:num_kv_blocks_used"] > 0
    stream.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    server.wait_metric("kvship:num_kv_blocks_used", lambda v: v == 0, timeout=10)
    assert server.metrics()["kvship:num_requests_running"] == 0
    assert time.monotonic() - t0 < 10
    gen_after = server.metrics()["kvship:generation_tokens_total"]
    time.sleep(1.0)
    assert server.metrics()["kvship:generation_tokens_total"] == gen_after  # nothing still generating


def test_disconnected_non_streaming_request_is_aborted(server, model):
    server.wait_metric("kvship:num_kv_blocks_used", lambda v: v == 0)
    body = {"model": model, "prompt": "Tell me everything. " * 10, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    server.wait_metric("kvship:num_requests_running", lambda v: v == 0, timeout=10)
    server.wait_metric("kvship:num_kv_blocks_used", lambda v: v == 0, timeout=5)


# ------------------------------------------------------------------ concurrency


def test_200_concurrent_requests(server, client, model):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "My favourite colour is", "Water boils at"]
    refs = {p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in prompts}

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        async with aclient:
            async def one(i):
                p = prompts[i % len(prompts)]
                if i % 2:
                    r = await aclient.completions.create(model=model, prompt=p, max_tokens=8, temperature=0)
                    return p, r.choices[0].text, r.choices[0].finish_reason, r.usage
                s = await aclient.completions.create(
                    model=model, prompt=p, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
                )
                text, finish, usage = "", None, None
                async for c in s:
                    if c.choices:
                        text += c.choices[0].text
                        finish = c.choices[0].finish_reason or finish
                    if c.usage:
                        usage = c.usage
                return p, text, finish, usage

            return await asyncio.gather(*(one(i) for i in range(200)))

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    assert len(results) == 200
    for p, text, finish, usage in results:
        ref = refs[p]
        assert text == ref.choices[0].text, (p, text, ref.choices[0].text)
        assert finish == ref.choices[0].finish_reason
        assert usage.model_dump() == ref.usage.model_dump()
    print(f"200 concurrent requests answered in {elapsed:.1f}s")
    server.wait_metric("kvship:num_kv_blocks_used", lambda v: v == 0, timeout=10)


def test_embeddings_on_a_generation_model_is_a_400(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "hello"}, timeout=30)
    err = assert_error(r, 400, "model")
    assert err["code"] == "wrong_task" and "completions" in err["message"]
