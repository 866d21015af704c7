"""Grammar-constrained output (xgrammar) with the bundled SmolLM2: through the official openai
SDK against a real `kvship serve`, and in the engine where constrained and free rows share a
batch."""
from __future__ import annotations

import enum
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import BaseModel, Field

from kvship.core.grammar import CACHE_BYTES, allowed_ids, check_schema, check_tool_parameters
from kvship.sampling_params import InvalidParamsError, SamplingParams, StructuredOutput
from server_utils import FLOAT32_WEIGHTS, assert_error, start_server


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
    # The float32 reference weights: which seeded samples of the 135M model close their JSON
    # within max_tokens is the model's luck, and the seeds below were picked on these weights.
    srv = start_server("--max-model-len", "1024", "--kv-cache-memory", "512MiB", "--max-num-seqs", "32",
                       *FLOAT32_WEIGHTS)
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



# -- what can never be produced: refused, or ended as an error (never "stop") -------------------

UNSATISFIABLE_SCHEMAS = [  # (schema, the keyword the refusal names)
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "maxLength"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1e9}, "minItems"),
    ({"type": "string", "minLength": 200_000}, "minLength"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
     "required"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "required"),  # strict output
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "required"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "maxProperties": 0}, "required"),
    ({"$ref": "http://example.com/schema.json"}, "$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}, "$ref"),
    ({"$ref": "other.json#/$defs/x"}, "$ref"),
    ({"anyOf": []}, "anyOf"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}}, "oneOf"),
    ({"enum": []}, "enum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1}, "minItems"),
    ({"type": "integer", "minimum": 10, "maximum": 3}, "minimum"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "exclusiveMinimum"),
    ({"type": "strng"}, "type"),
    ({"type": "object", "properties": {"a": 7}}, "properties"),
]


def test_invalid_or_unsatisfiable_schemas_name_the_keyword():
    for schema, word in UNSATISFIABLE_SCHEMAS:
        with pytest.raises(InvalidParamsError) as info:
            check_schema(schema, "response_format")
        assert repr(word) in str(info.value), (schema, str(info.value))
        assert info.value.param == "response_format"
    for params in ({"type": "string"}, {"type": "array", "items": {}}, {"type": "object", "properties": {"a": 3}},
                   {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}):
        with pytest.raises(InvalidParamsError):
            check_tool_parameters(params, "tools[0].function.parameters")
    check_tool_parameters({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "t")
    check_tool_parameters({"properties": {}}, "t")  # no type: an object schema all the same


@pytest.fixture(scope="module")
def grammars(llm):
    return llm.engine.grammars


def _refused(grammars, kind: str, spec: object, param: str = "guided_grammar") -> str:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    with pytest.raises(InvalidParamsError) as info:
        grammars.prepare(StructuredOutput(kind, text, param=param))
    assert info.value.param == param
    return str(info.value)


def test_grammars_that_can_produce_nothing_are_refused(grammars):
    nothing = [
        ("json", {"$ref": "#"}),
        ("json", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        ("json", {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),  # no end
        ("json", {"type": "object", "properties": {"x": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["x"]}),
        ("grammar", "root ::= root"),
        ("grammar", 'root ::= "a" root'),
        ("grammar", 'root ::= "<" item ">"\nitem ::= "x" item | item "y"'),
        ("grammar", 'root ::= "q" [^\\x00-\\U0010FFFF]'),
        ("regex", "[^\\s\\S]"),
    ]
    for kind, spec in nothing:
        message = _refused(grammars, kind, spec)
        assert "no complete output" in message, (spec, message)
    # a way that can never end, beside ways that can: refused too (the model might take it)
    assert "never be completed" in _refused(grammars, "grammar", 'root ::= "a" loop | "b"\nloop ::= "x" loop')
    assert "never be completed" in _refused(
        grammars, "json", {"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/l"}], "$defs": {"l": {"$ref": "#/$defs/l"}}})
    # what can end passes, recursion included
    for kind, spec in [("json", {"type": "object", "properties": {"child": {"$ref": "#"}}}),
                       ("json", Person.model_json_schema()),
                       ("grammar", 'root ::= "a" root | "b"'),
                       ("grammar", 'root ::= "(" root ")" | ""'),
                       ("regex", "[a-z]+@[a-z]+"),
                       ("structural_tag", {"type": "structural_tag", "format": {
                           "type": "triggered_tags", "triggers": ["<f>"], "tags": [
                               {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "object"}},
                                "end": "</f>"}]}}),
                       ("json_object", "")]:
        grammars.prepare(StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec), param="p"))


def test_grammar_engine_errors_reach_clients_clean(grammars):
    for kind, spec in [("json", {"type": "string", "pattern": "[a-z]{1,300}"}),  # fails an internal check
                       ("json", {"type": "integer", "minimum": 1.5, "maximum": 1.7}),
                       ("regex", "(unclosed"),
                       ("grammar", "root ::= undefined_rule"),
                       ("grammar", 'root ::= "a'),
                       ("structural_tag", {"type": "structural_tag", "triggers": ["<f>"], "structures": [
                           {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}]})]:
        message = _refused(grammars, kind, spec)
        assert not re.search(r"\.(cc|h|cpp)\b|/project/|^\[\d|Check failed", message), message
        assert message.strip()


def test_dead_end_at_run_time_ends_as_an_error(llm, grammars):
    """A grammar with a way that dead-ends deep inside (past what the compile-time search
    follows): a sequence sent down it ends with finish_reason "error", never "stop"."""
    spec = StructuredOutput("grammar", 'root ::= [a-z] [a-z] ("x" [^\\x00-\\U0010FFFF] | "y")', param="guided_grammar")
    x = llm.engine.tokenizer.encode("x", add_special_tokens=False)
    assert len(x) == 1
    towards_x = SamplingParams(temperature=0, max_tokens=10, logit_bias={x[0]: 100.0}, structured=spec)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    dead, other = llm.generate(["Letters:", "The capital of France is"], [towards_x, free])
    assert dead.outputs[0].finish_reason == "error", dead.outputs[0]
    assert dead.outputs[0].text == "xxx"
    assert other.outputs[0].finish_reason == "length" and len(other.outputs[0].token_ids) == 8
    # the bitmask of a dead-ended matcher lets only end-of-text through, which the matcher refuses
    m = grammars.matcher(spec)
    for _ in range(3):
        assert m.accept_token(x[0])
    row = grammars.bitmask([None, m])[1]
    stop = sorted(llm.engine.tokenizer.eos_token_ids)
    assert allowed_ids(row, grammars.vocab_size) == stop
    assert not m.accept_token(stop[0])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_compiled_grammars_memory_levels_off(grammars):
    """Every distinct schema compiles to a grammar of about a megabyte here; both caches (ours and
    xgrammar's) are bounded by bytes, so that a stream of distinct schemas does not grow memory."""
    t0 = time.monotonic()
    rss = {}
    for i in range(1000):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40 + i % 7},
                                                   "tag": {"enum": [f"t{i}", f"u{i}"]}}, "required": ["name", "tag"]}
        grammars.prepare(StructuredOutput("json", json.dumps(schema), param="response_format"))
        if i + 1 in (100, 1000):
            rss[i + 1] = _rss_mb()
    assert rss[1000] - rss[100] < 200, rss
    assert grammars.cached_bytes <= CACHE_BYTES
    assert 0 < grammars._compiler.get_cache_size_bytes() <= CACHE_BYTES
    assert time.monotonic() - t0 < 300


def test_unsatisfiable_constraints_are_400s_naming_the_keyword(server):
    chat = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def rf(schema):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    def tool(parameters, choice="required"):
        return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                "tool_choice": choice}

    cases = [(chat, rf(schema), "response_format", word) for schema, word in UNSATISFIABLE_SCHEMAS[:12]] + [
        (chat, rf({"$ref": "#"}), "response_format", "no complete output"),
        (chat, {"guided_json": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}},
         "guided_json", "no complete output"),
        (chat, {"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "no complete output"),
        (server.url + "/v1/completions", {"prompt": "x", "guided_grammar": 'root ::= "a" root'}, "guided_grammar",
         "no complete output"),
        (server.url + "/v1/completions", {"prompt": "x", "guided_regex": "[^\\s\\S]"}, "guided_regex",
         "no complete output"),
        (chat, tool({"type": "string"}), "tools[0].function.parameters", "object"),
        (chat, tool({"type": "array", "items": {"type": "string"}}, {"type": "function", "function": {"name": "f"}}),
         "tools[0].function.parameters", "object"),
        (chat, tool({"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}),
         "tools[0].function.parameters", "$ref"),
        (chat, tool({"type": "object", "properties": {"a": {"type": "string", "minLength": -2}}}),
         "tools[0].function.parameters", "minLength"),
        (chat, tool({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}), "tools",
         "required"),
        (chat, {"guided_json": {"type": "string", "pattern": "[a-z]{1,300}"}}, "guided_json", "cannot be used"),
    ]
    for url, extra, param, word in cases:
        body = {"messages": msgs} if url == chat else {}
        err = assert_error(httpx.post(url, json={**body, "max_tokens": 4, **extra}, timeout=60), 400, param)
        assert word in err["message"], (extra, err)
        assert not re.search(r"\.(cc|h|cpp)\b|/project/", err["message"]), err
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 4,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"anyOf": []}}}})
    assert r.status_code == 400 and "anyOf" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_dead_end_is_a_visible_error_through_the_api(client, model, server):
    """A grammar the compile-time checks cannot prove dead, driven into its dead end (logit_bias
    on "x"): finish_reason "error" on chat and completions, streamed or not; never "stop"."""
    grammar = 'root ::= [a-z] [a-z] ("x" [^\\x00-\\U0010FFFF] | "y")'
    (x,) = httpx.post(server.url + "/tokenize", json={"prompt": "x", "add_special_tokens": False},
                      timeout=30).json()["tokens"]
    extra = {"guided_grammar": grammar}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Letters?"}], max_tokens=10,
                                       temperature=0, logit_bias={str(x): 100}, extra_body=extra)
    assert r.choices[0].finish_reason == "error", r.choices[0]
    r = client.completions.create(model=model, prompt="Letters:", max_tokens=10, temperature=0,
                                  logit_bias={str(x): 100}, extra_body=extra)
    assert r.choices[0].finish_reason == "error", r.choices[0]
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Letters?"}],
                                            max_tokens=10, temperature=0, logit_bias={str(x): 100}, stream=True,
                                            extra_body=extra)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "error" and "stop" not in reasons, reasons
    # the same grammar left to itself ends on its own way ("y")
    r = client.completions.create(model=model, prompt="Letters:", max_tokens=10, temperature=0,
                                  logit_bias={str(x): -100}, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("y"), r.choices[0]
