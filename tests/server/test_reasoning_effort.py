"""How hard gpt-oss thinks: chat's `reasoning_effort` and the Responses API's `reasoning.effort`
reach the chat template, which writes harmony's "Reasoning: low|medium|high" into the system
message (medium when none is asked for), as vLLM passes it. Through a real `kvship serve` of a
tiny random gpt-oss with a byte-level tokenizer (a byte a token, so the prompt's length tells
which word the template wrote); a bad value or a reasoning summary is a 400."""
from __future__ import annotations

import httpx
import pytest

from conftest import make_tiny_model
from server_utils import assert_error, start_server
from test_tool_templates import write_byte_tokenizer

pytestmark = pytest.mark.timeout(300)

# gpt-oss's chat template, its system message shortened to fit the tiny model's 256 positions
# (the tools and channels of later turns left out: only the effort line is under test)
HARMONY_TEMPLATE = """{%- if not reasoning_effort is defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{{- "<|start|>system<|message|>Knowledge cutoff: 2024-06\\n\\nReasoning: " + reasoning_effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final.<|end|>" }}
{%- for message in messages %}
{%- if message.role in ("system", "developer") %}
{{- "<|start|>developer<|message|># Instructions\\n\\n" + message.content + "<|end|>" }}
{%- elif message.role == "user" %}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == "assistant" %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}"""
HARMONY_SPECIALS = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                    "<|call|>", "<|return|>")  # <|return|> ends generation: the tiny model's eos
SPEC = ("GptOssConfig", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=8, layer_types=["sliding_attention", "full_attention"]))
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony") / "gpt-oss"
    make_tiny_model(folder, "gpt_oss", spec=SPEC)
    write_byte_tokenizer(folder, 320, HARMONY_TEMPLATE, HARMONY_SPECIALS)
    srv = start_server(str(folder), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                       "--reasoning-parser", "harmony")
    yield srv
    assert srv.stop() == 0, srv.log()


def _chat(server, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=120,
                      json={"messages": ASK, "max_tokens": 1, "temperature": 0, **fields})


def _respond(server, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", timeout=120,
                      json={"input": ASK[0]["content"], "max_output_tokens": 1, "temperature": 0, **fields})


def test_chat_reasoning_effort_is_written_into_the_system_message(server):
    tokens = {}
    for effort in ("low", "medium", "high", None):
        r = _chat(server, **({} if effort is None else {"reasoning_effort": effort}))
        assert r.status_code == 200, r.text
        tokens[effort] = r.json()["usage"]["prompt_tokens"]
    # a byte a token: the three words' lengths, and medium when none is asked for
    assert (tokens["medium"] - tokens["low"], tokens["high"] - tokens["low"]) == (3, 1)
    assert tokens[None] == tokens["medium"]
    # chat_template_kwargs reach the template the same way (vLLM's other spelling)
    r = _chat(server, chat_template_kwargs={"reasoning_effort": "high"})
    assert r.json()["usage"]["prompt_tokens"] == tokens["high"]
    assert_error(_chat(server, reasoning_effort="extreme"), 400)


def test_responses_reasoning_effort_is_written_into_the_system_message(server):
    tokens = {}
    for effort in ("low", "medium", "high", None):
        r = _respond(server, reasoning={} if effort is None else {"effort": effort})
        assert r.status_code == 200, r.text
        tokens[effort] = r.json()["usage"]["input_tokens"]
        assert r.json()["reasoning"] == {"effort": effort, "summary": None}  # echoed as OpenAI's response does
    assert (tokens["medium"] - tokens["low"], tokens["high"] - tokens["low"]) == (3, 1)
    assert tokens[None] == tokens["medium"]
    # with instructions (a developer message) the effort still goes to the system message
    r = _respond(server, reasoning={"effort": "high"}, instructions="Be brief.")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > tokens["high"]
    assert_error(_respond(server, reasoning={"effort": "extreme"}), 400)
    err = assert_error(_respond(server, reasoning={"effort": "low", "summary": "auto"}), 400, "reasoning.summary")
    assert "not supported" in err["message"]
