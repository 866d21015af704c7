"""Tools with the chat templates models actually ship, against servers started with no tool
flags: a tiny random Qwen2 whose template carries tools (Qwen2.5's hermes format), and the
bundled SmolLM2, whose ChatML template shows no tools and gets kvship's tool prompt
(server/tool_prompt.py, docs/tools.md). Through langchain-openai as applications call it."""
# ruff: noqa: E501 (the Qwen2.5 template below is kept as published, long lines included)
from __future__ import annotations

import json
from pathlib import Path

import httpx
import langchain_openai
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from kvship.core.grammar import Grammars
from kvship.server.protocol import ChatCompletionRequest
from kvship.server.tool_prompt import template_shows_tools, tool_format, with_tool_prompt
from kvship.server.tools import ToolStream, tool_plan
from server_utils import start_server

# Qwen2.5-Instruct's chat template (its tool parts as published): tools in the system turn,
# calls as <tool_call> blocks, results as user turns of <tool_response> blocks.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
# Arguments a random model can only finish: an enum, at most one blank between JSON tokens.
SET_UNIT = {"type": "function", "function": {
    "name": "set_unit", "description": "Set the temperature unit",
    "parameters": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["unit"], "additionalProperties": False}}}
ASK = "What is the weather in Paris?"
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": ASK},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "Rain, 14 C"},
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies are written in it)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_byte_tokenizer(folder: Path, vocab_size: int, chat_template: str,
                         specials: tuple[str, ...] = QWEN_SPECIALS) -> None:
    """A byte-level tokenizer (one token per byte, no merges: any text, JSON included) with the
    model's special tokens last (Qwen's by default): the first is the pad token, the last the
    last id (the tiny model's eos)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - 256 - len(specials))]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in reserved + list(specials)])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(specials[-1]) == vocab_size - 1
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": specials[-1], "pad_token": specials[0], "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template, "add_bos_token": False}))


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen2 with a byte-level tokenizer and Qwen2.5's template (a byte a token:
    the prompts run to a thousand positions)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tools") / "qwen2-tools"
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   eos_token_id=319, bos_token_id=317, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    write_byte_tokenizer(folder, cfg.vocab_size, QWEN25_TEMPLATE)
    return folder


def _tokenizer(folder: Path):
    from kvship.loader.tokenizer import Tokenizer

    return Tokenizer.from_hf_folder(str(folder))


@pytest.fixture(scope="module")
def smollm2_tokenizer(bundled):
    from kvship.loader.gguf import load_gguf

    return load_gguf(bundled).tokenizer


def _request(messages=HISTORY, tools=(WEATHER,), **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": list(messages), "tools": list(tools), **extra})


# ------------------------------------------------------------------ the format, no server

def test_what_each_template_can_show(qwen_folder, smollm2_tokenizer):
    qwen = _tokenizer(qwen_folder)
    assert template_shows_tools(qwen) and not template_shows_tools(smollm2_tokenizer)
    assert tool_format(qwen).card() == {"parser": "hermes", "parser_source": "chat template", "prompt": "chat_template"}
    assert tool_format(smollm2_tokenizer).card() == {"parser": "hermes", "parser_source": "tool prompt",
                                                     "prompt": "kvship"}
    assert tool_format(smollm2_tokenizer, "mistral").parser == "mistral"  # a parser given wins


@pytest.mark.parametrize("template,shows", [
    # tools rendered, but a call is an empty assistant turn: not enough
    ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
     "{% endfor %}", False),
    # everything rendered (tools, calls' arguments, results)
    ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
     "{% for c in m.tool_calls or [] %}{{ c.function | tojson }}{% endfor %}\n{% endfor %}", True),
    # Mistral's templates take call ids of nine letters and digits only
    ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}{{ m.content }}"
     "{% for c in m.tool_calls or [] %}{% if c.id | length != 9 %}{{ raise_exception('ids of 9') }}{% endif %}"
     "[TOOL_CALLS]{{ c.function | tojson }}{% endfor %}{% endfor %}", True),
    # a template that refuses the tool role
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{{ m.content }}"
     "{% endfor %}", False),
])
def test_template_probe(qwen_folder, template, shows):
    tok = _tokenizer(qwen_folder)
    tok.chat_template = template
    assert template_shows_tools(tok) is shows


@pytest.mark.parametrize("mark,parser", [("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                                         ("<tool_call>", "hermes"), ("<|tool|>", "hermes"),
                                         ("<tool_call><arg_key>", "glm45")])  # GLM-4.5's beside its <tool_call>
def test_parser_from_the_template(qwen_folder, mark, parser):
    tok = _tokenizer(qwen_folder)
    tok.chat_template = ("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for m in messages %}"
                         "{{ m.content }}{% for c in m.tool_calls or [] %}" + mark + "{{ c.function | tojson }}"
                         "{% endfor %}{% endfor %}")
    fmt = tool_format(tok)
    assert fmt.parser == parser and not fmt.injected
    assert fmt.source == ("default" if mark == "<|tool|>" else "chat template")


def test_tool_prompt_rewrites_the_conversation():
    plain = [m.template_dict() for m in _request().messages]
    out = with_tool_prompt(plain, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert "<tool_call>" in system and "</tool_call>" in system
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    assert "tool_calls" not in out[2]
    assert out[3]["content"] == ("<tool_response>\nSunny, 21 C\n</tool_response>\n"
                                 "<tool_response>\nRain, 14 C\n</tool_response>")
    # no system message: the tool prompt is one; no tools (tool_choice "none"): history only
    assert with_tool_prompt(plain[1:2], [WEATHER])[0]["role"] == "system"
    assert with_tool_prompt(plain, None)[0] == plain[0]


def test_bundled_prompt_shows_tools_calls_and_results(smollm2_tokenizer):
    """What SmolLM2 reads: the tool definitions and the earlier calls and results (its own
    template renders none of them)."""
    from kvship.server.prompts import render_chat

    body = _request()
    text = render_chat(smollm2_tokenizer, body.messages, True, {"tools": [WEATHER]})
    assert json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in text
    assert "Sunny, 21 C" in text and "<tool_response>" in text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and text.endswith("<|im_start|>assistant\n")
    # the template's own rendering of the same request drops all of it
    own = smollm2_tokenizer.apply_chat_template([m.template_dict() for m in body.messages], tools=[WEATHER])
    assert "get_weather" not in own


def test_omitted_tool_choice_means_auto():
    plan = tool_plan(_request(), "hermes")
    assert plan.mode == "auto" and plan.parser == "hermes" and plan.constraint() is None
    assert tool_plan(_request(), None).parser == "hermes"
    assert tool_plan(_request(tool_choice="none"), "hermes") is None


def test_hermes_constraint_is_the_models_own_format(smollm2_tokenizer):
    """A named call, or "required" without parallel calls, with the hermes format: one
    <tool_call> block with valid arguments. "required" with parallel calls stays a JSON array."""
    grammars = Grammars(smollm2_tokenizer, smollm2_tokenizer.vocab_size, {smollm2_tokenizer.eos_token_id})
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = one + "\n" + one.replace("get_weather", "set_unit").replace('"city": "Paris"', '"unit": "f"')

    def accepts(choice, text: str, parallel: bool = True) -> bool:
        spec = tool_plan(_request(tools=[WEATHER, SET_UNIT], tool_choice=choice, parallel_tool_calls=parallel),
                         "hermes").constraint()
        assert spec.kind == "structural_tag", spec
        m = grammars.matcher(spec)
        return m.accept_string(text) and m.accept_token(smollm2_tokenizer.eos_token_id)

    named = {"type": "function", "function": {"name": "get_weather"}}
    single = "required", False
    for choice, parallel in (single, (named, True)):
        assert accepts(choice, one, parallel) and not accepts(choice, two, parallel)
        assert not accepts(choice, "Sure. " + one, parallel)  # nothing before the call
        assert not accepts(choice, "", parallel)  # a call
        assert not accepts(choice, one.replace('"Paris"', '"' + "x" * 21 + '"'), parallel)  # maxLength 20
    assert accepts(*single[:1], one.replace("get_weather", "set_unit").replace('"city": "Paris"', '"unit": "f"'),
                   False)
    assert not accepts(named, one.replace('"city": "Paris"', '"unit": "c"'))  # not the named tool's arguments
    plan = tool_plan(_request(tool_choice="required"), "hermes")
    assert plan.constraint().kind == "json" and json.loads(plan.constraint().spec)["type"] == "array"
    # what it generates is read by the hermes parser, in one piece or many
    for cuts in ([], [5, 30, len(one) - 3]):
        stream = ToolStream(tool_plan(_request(tool_choice=named), "hermes"))
        pieces = [(one + "\n")[a:b] for a, b in zip([0, *cuts], [*cuts, len(one) + 1])]
        outs = [stream.feed(p) for p in pieces] + [stream.end()]
        assert "".join(c for c, _ in outs) == ""  # the line break after the call is not content
        deltas = [d for _, ds in outs for d in ds]
        assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == ["get_weather"]
        assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"city": "Paris"}'



def test_unsupported_schema_in_a_hermes_constraint_is_refused():
    from kvship.sampling_params import InvalidParamsError

    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "credit-card"}}}}}
    with pytest.raises(InvalidParamsError) as info:
        tool_plan(_request(tools=[bad], tool_choice="required", parallel_tool_calls=False), "hermes").constraint()
    assert info.value.param == "tools"


# ------------------------------------------------------------------ servers with no tool flags

def _llm(server, model: str, **kw) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(model=model, base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                       timeout=300, **kw)


def _card(server) -> dict:
    (card,) = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    return card


@pytest.fixture(scope="module")
def qwen_server(qwen_folder):
    srv = start_server(str(qwen_folder), "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory",
                       "64MiB")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_tiny_qwen_template_langchain_calls_the_tool(qwen_server, qwen_folder):
    """A model whose template carries tools, no tool flags: the parser comes from the template;
    LangChain's named and "any" choices come back as parsed calls (random weights: only a
    constrained call is certain, and it is generated as <tool_call> text that the hermes parser
    must read), and the agent's next turn (tools, no tool_choice) is served as "auto"."""
    card = _card(qwen_server)
    assert card["tool_calling"] == {"parser": "hermes", "parser_source": "chat template", "prompt": "chat_template"}
    assert "parser hermes (from chat template)" in qwen_server.log()
    llm = _llm(qwen_server, card["id"], temperature=1.0, max_tokens=200, seed=3)
    for choice, parallel in (("set_unit", None), ("any", False)):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        ai = llm.bind_tools([SET_UNIT, WEATHER] if choice == "any" else [SET_UNIT], tool_choice=choice, **kw).invoke(ASK)
        assert isinstance(ai, AIMessage) and ai.content == "", ai
        (call,) = ai.tool_calls
        if choice == "set_unit":
            assert call["name"] == "set_unit" and call["args"]["unit"] in ("c", "f")
        assert call["id"].startswith("call_") and ai.response_metadata["finish_reason"] == "tool_calls"
    # the follow-up turn: the call and its result go back, tools bound, no tool_choice
    history = [HumanMessage(ASK), ai, ToolMessage("done", tool_call_id=ai.tool_calls[0]["id"])]
    reply = llm.bind_tools([SET_UNIT, WEATHER]).invoke(history)
    assert isinstance(reply, AIMessage) and reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_tiny_qwen_template_renders_the_tools_itself(qwen_server, qwen_folder):
    """The template's own tool rendering is used (no kvship prompt): the prompt has as many
    tokens as transformers' rendering of the same request with the same template."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_folder))
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=_card(qwen_server)["id"], messages=HISTORY, tools=[WEATHER], max_tokens=1)
    want = hf.apply_chat_template([m.template_dict() for m in _request().messages], tools=[WEATHER],
                                  add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert r.usage.prompt_tokens == len(want)
    text = hf.decode(want)
    assert json.dumps(WEATHER) in text and '"city": "Lyon"' in text and "Rain, 14 C" in text


@pytest.fixture(scope="module")
def smol_server():
    srv = start_server("--max-model-len", "2048", "--kv-cache-memory", "256MiB")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_bundled_model_tools_without_flags(smol_server, smollm2_tokenizer):
    """SmolLM2 served with no tool flags: the card and log say kvship's prompt stands in; "auto"
    (omitted or given) is accepted; the prompt the model reads is the one with the tools, the
    earlier calls and their results; "required" comes back parsed from <tool_call> text."""
    from kvship.server.prompts import chat_prompt_ids

    card = _card(smol_server)
    assert card["tool_calling"] == {"parser": "hermes", "parser_source": "tool prompt", "prompt": "kvship"}
    assert "kvship's tool prompt stands in" in smol_server.log()
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for extra in ({}, {"tool_choice": "auto"}):
        r = client.chat.completions.create(model=card["id"], messages=HISTORY, tools=[WEATHER], max_tokens=8,
                                           temperature=0, **extra)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        want = chat_prompt_ids(smollm2_tokenizer, _request().messages, True, {"tools": [WEATHER]})
        assert r.usage.prompt_tokens == len(want)
    # /tokenize renders the same history (no tools there): the calls and results are in it
    ids = httpx.post(smol_server.url + "/tokenize", json={"messages": HISTORY}, timeout=60).json()["tokens"]
    text = httpx.post(smol_server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in text and "Rain, 14 C" in text
    # required: the hermes format, parsed
    llm = _llm(smol_server, card["id"], temperature=0, max_tokens=80)
    ai = llm.bind_tools([WEATHER], tool_choice="any", parallel_tool_calls=False).invoke(ASK)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and ai.content == ""


def test_bundled_model_langchain_agent_turns(smol_server):
    """LangChain's bind_tools without tool_choice, first turn and the turn after a tool result:
    both served (a 400 without server flags before)."""
    llm = _llm(smol_server, _card(smol_server)["id"], temperature=0, max_tokens=40)
    bound = llm.bind_tools([WEATHER])
    first = bound.invoke(ASK)
    assert isinstance(first, AIMessage)
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}
    second = bound.invoke([HumanMessage(ASK), AIMessage("", tool_calls=[call]),
                           ToolMessage("Sunny, 21 C", tool_call_id="call_1")])
    assert isinstance(second, AIMessage) and (second.content or second.tool_calls)
