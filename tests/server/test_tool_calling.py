"""Tool calling and reasoning content: the parsers on their own (every split of the text into
stream deltas gives the same result as the whole text), and through the official openai SDK and
langchain-openai against a real `kvship serve` of the bundled SmolLM2."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from kvship.server.protocol import ChatCompletionRequest
from kvship.server.reasoning import ReasoningStream
from kvship.server.tools import ToolStream, tool_plan
from server_utils import assert_error, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------ parsers, no server

def _plan(parser: str | None, choice: object = "auto"):
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": choice})
    return tool_plan(body, parser)


def _run(stream, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed `text` cut at `cuts`, then end; (content, tool calls reassembled as the SDK does)."""
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = "", {}
    for out in [stream.feed(p) for p in pieces] + [stream.end()]:
        content += out[0]
        for d in out[1]:
            call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            fn = d.get("function", {})
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def _every_split(make_stream, text: str, want: tuple[str, list[dict]]) -> None:
    rng = random.Random(0)
    splits = [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
                                                  for _ in range(40)]
    for cuts in [[], *splits]:
        assert _run(make_stream(), text, cuts) == want, cuts


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               '</tool_call><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    ("hermes", "<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    # the line breaks between and after calls are not content; text after them is
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "add", '
               '"arguments": {"a": 3, "b": 4}}</tool_call>\n', "", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n\nDone.', "\n\nDone.",
     [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}',
     "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "f"})]),
    ("llama3_json", "{ not a call", "{ not a call", []),
    ("llama3_json", "Plain answer.", "Plain answer.", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 5, "b": 6}}]', "", [("add", {"a": 5, "b": 6})]),
    ("mistral", "[TOOL plain text", "[TOOL plain text", []),
    # GLM-4.5's format: values JSON unless the schema says string (a numeric-looking city stays text)
    ("glm45", "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>2024</arg_value>\n"
              "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>"
              "\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>-2</arg_value>\n</tool_call>\n",
     "Let me check.", [("get_weather", {"city": "2024", "unit": "c"}), ("add", {"a": 1, "b": -2})]),
    ("glm45", "<tool_call>not a\ncall</tool_call> done", "<tool_call>not a\ncall</tool_call> done", []),
    ("glm45", "No tools: 2 < 3 and <tool is not a tag.", "No tools: 2 < 3 and <tool is not a tag.", []),
])
def test_tool_call_parsers_on_any_stream_split(parser, text, content, calls):
    want = (content, [{"name": n, "arguments": json.dumps(a)} for n, a in calls])
    _every_split(lambda: ToolStream(_plan(parser)), text, want)


ARGS = '{"city": "Pa}ris\\"", "unit": {"x": [1, {"y": "c,"}]}}'  # braces, a comma and a quote inside strings


@pytest.mark.parametrize("parser,choice,text", [
    ("hermes", "auto", f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'),
    ("hermes", "auto", f'<tool_call>{{"name": "get_weather", "arguments": {ARGS}, "id": 7}}</tool_call>'),
    ("llama3_json", "auto", f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}'),
    ("mistral", "auto", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}]'),
    (None, "required", f'[{{"name": "get_weather", "parameters": {ARGS}}}]'),
])
def test_call_arguments_stream_in_pieces(parser, choice, text):
    """Fed a character at a time, a call sends its id and name as soon as its head is complete
    (with the arguments' first character), then its arguments as the model writes them, ending
    exactly where their JSON value ends (keys after it are read past), not all at the end."""
    stream, pieces, named_at = ToolStream(_plan(parser, choice)), [], None
    for i, ch in enumerate(text):
        for d in stream.feed(ch)[1]:
            if d.get("function", {}).get("name"):
                assert d["id"].startswith("call_") and d["type"] == "function"
                named_at = i
            pieces.append(d["function"].get("arguments", ""))
    pieces += [d["function"].get("arguments", "") for d in stream.end()[1]]
    assert named_at == text.index(ARGS)
    assert "".join(pieces) == ARGS and len([p for p in pieces if p]) > 20


def test_call_in_another_key_order_comes_whole():
    text = '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>'
    _every_split(lambda: ToolStream(_plan("hermes")), text, ("", [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]))


def test_required_and_named_outputs():
    out = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "X", "unit": "c"}}]'
    want = ("", [{"name": "add", "arguments": '{"a": 1, "b": 2}'},
                 {"name": "get_weather", "arguments": '{"city": "X", "unit": "c"}'}])
    _every_split(lambda: ToolStream(_plan(None, "required")), out, want)
    named = {"type": "function", "function": {"name": "add"}}
    _every_split(lambda: ToolStream(_plan(None, named)), '{"a": 3, "b": 4}',
                 ("", [{"name": "add", "arguments": '{"a": 3, "b": 4}'}]))
    # the constraint of each: a schema the grammar compiler takes
    assert json.loads(_plan(None, named).constraint().spec) == ADD["function"]["parameters"]
    schema = json.loads(_plan(None, "required").constraint().spec)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "The answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    ("qwen3", "<thin is not a tag", "", "<thin is not a tag"),
    ("deepseek_r1", "Thinking here.</think>Answer.", "Thinking here.", "Answer."),
    ("deepseek_r1", "<think>Thinking</think>\nAnswer.", "Thinking", "Answer."),
    ("deepseek_r1", "Never closes", "Never closes", ""),
])
def test_reasoning_parsers_on_any_stream_split(parser, text, reasoning, content):
    rng = random.Random(1)
    for cuts in [[], *[[i] for i in range(1, len(text))],
                 *[sorted(rng.sample(range(1, len(text)), 4)) for _ in range(30)]]:
        stream = ReasoningStream(parser)
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        outs = [stream.feed(p) for p in pieces] + [stream.end()]
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning, content), cuts


# ------------------------------------------------------------------ through the server

@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "1024", "--kv-cache-memory", "512MiB", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == 0, srv.log()


def _valid(call) -> dict:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 30
    else:
        assert call.function.name == "add" and isinstance(args["a"], int) and isinstance(args["b"], int)
    return args


def test_named_and_required_calls_are_valid(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named, seed=seed,
                                           temperature=1.0, max_tokens=100)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        _valid(call)
        r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                                           temperature=1.0, max_tokens=200, parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
        _valid(r.choices[0].message.tool_calls[0])


def test_streamed_call_reassembles_to_the_same_arguments(client, model):
    # one call each (the bundled model, shown the tools, goes on repeating a call while it may)
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        kw = dict(model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                  tool_choice=choice, temperature=0, max_tokens=200, parallel_tool_calls=False)
        whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
        with client.chat.completions.stream(**kw) as stream:  # the SDK's own reassembly
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in whole]


def test_tool_results_round_trip_through_the_template(client, model):
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = first.choices[0].message
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "Sunny, 21 C"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    # auto with the hermes parser: this model answers in text, which stays text
    assert not r.choices[0].message.tool_calls


def test_tool_mistakes_are_400s(server):
    url = server.url + "/v1/chat/completions"
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "credit-card"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{{ raise_exception('x') }}"}}, "chat_template_kwargs"),
    ]
    for extra, param in cases:
        assert_error(httpx.post(url, json={"messages": ASK, "max_tokens": 4, **extra}, timeout=60), 400, param)


def test_langchain_structured_output_and_tools(server, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=30)
        celsius: int = Field(ge=-50, le=60)

    llm = langchain_openai.ChatOpenAI(model=model, base_url=server.url + "/v1", api_key="unused", temperature=0,
                                      max_tokens=120, max_retries=0, timeout=300)
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Weather, method=method).invoke("The weather in Paris?")
        assert isinstance(got, Weather), method
    ai = llm.bind_tools(TOOLS, tool_choice="get_weather").invoke("The weather in Paris?")
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}


def test_auto_needs_no_server_flag():
    # tools without tool_choice (LangChain's bind_tools, an agent's every turn) mean "auto", as in
    # OpenAI's API; the parser is chosen from the model's template when none was given
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS})
    plan = tool_plan(body, None)
    assert plan.mode == "auto" and plan.parser == "hermes"
