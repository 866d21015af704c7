"""Grammar-constrained output (xgrammar) with the bundled SmolLM2: through the official openai
SDK against a real `kvship serve`, and in the engine where constrained and free rows share a
batch."""
from __future__ import annotations

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel, Field

from kvship.core.grammar import check_schema
from kvship.sampling_params import InvalidParamsError, SamplingParams, StructuredOutput
from server_utils import assert_error, start_server


class Mood(str, enum.Enum):
    happy = "happy"
    sad = "sad"
    calm = "calm"


class Pet(BaseModel):
    name: str = Field(max_length=20)
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    mood: Mood
    pets: list[Pet] = Field(max_length=3)
    nickname: str | None = None
    height_m: float = Field(ge=0.5, le=2.5)


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "1024", "--kv-cache-memory", "512MiB", "--max-num-seqs", "32")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_parse_nested_pydantic_model_every_time(client, model):
    def ask(seed: int):
        return client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Describe a person and their pets."}],
            response_format=Person, seed=seed, temperature=1.0, max_tokens=400)

    with ThreadPoolExecutor(20) as pool:  # the engine batches them
        replies = list(pool.map(ask, range(20)))
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person)  # the SDK validated it against the model
        assert len(choice.message.parsed.pets) <= 3


def test_json_object_regex_and_choice(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       response_format={"type": "json_object"}, max_tokens=200, seed=1)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    # vLLM's fields, on completions and chat; n > 1: every choice constrained
    r = client.completions.create(model=model, prompt="Call me at", n=3, temperature=1.0, max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert all(re.fullmatch(r"\d{3}-\d{4}", c.text) and c.finish_reason == "stop" for c in r.choices), r.choices
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is fire cold?"}],
                                       max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=model, prompt="Colour:", max_tokens=10, logprobs=2,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "red" | "blue"'}})
    assert r.choices[0].text in ("red", "blue") and len(r.choices[0].logprobs.tokens) >= 1


def test_streamed_json_schema(client, model):
    schema = Person.model_json_schema()
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}], stream=True, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    text, reasons = "", []
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            reasons.append(c.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    Person.model_validate_json(text)


def test_length_when_max_tokens_runs_out_first(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person."}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": Person.model_json_schema()}}, max_tokens=5)
    assert r.choices[0].finish_reason == "length"


def test_unservable_constraints_are_400s(server):
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ]
    for extra, param in cases:
        err = assert_error(httpx.post(url, json={"messages": msgs, "max_tokens": 4, **extra}, timeout=60), 400, param)
        assert err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_schema_check_names_what_is_not_enforced():
    check_schema(Person.model_json_schema(), "response_format")  # what pydantic writes passes
    for bad, word in [({"allOf": [{"type": "string"}]}, "allOf"),
                      ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                      ({"type": "object", "properties": {"a": {"if": {}}}}, "if"),
                      ({"type": "string", "format": "credit-card"}, "credit-card")]:
        with pytest.raises(InvalidParamsError, match=word) as info:
            check_schema(bad, "response_format")
        assert info.value.param == "response_format"


@pytest.fixture(scope="module")
def llm(bundled):
    from kvship.llm import LLM

    return LLM(device="cpu", num_kv_blocks=256)


def test_constrained_and_free_rows_share_a_batch(llm):
    """A grammar's bitmask touches only its own rows, and reading the previous step early for it
    leaves the free rows' tokens as they are alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Count: one, two,"]
    alone = [o.outputs[0].text for o in llm.generate(prompts, free)]
    digits = SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutput("regex", r"[0-9]{1,12}"))
    mixed = llm.generate(prompts + ["My number is"], [free, free, digits])
    assert [o.outputs[0].text for o in mixed[:2]] == alone
    assert re.fullmatch(r"[0-9]{1,12}", mixed[2].outputs[0].text)
