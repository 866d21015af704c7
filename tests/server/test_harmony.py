"""gpt-oss's harmony output (--reasoning-parser harmony) as OpenAI's assistant message: the
analysis channel as reasoning_content, the final channel as content, bodies addressed to
functions.NAME as tool calls; the same result whether the text arrives whole or a character
at a time; output not in the format passed through as content. The texts follow OpenAI's
published harmony format (github.com/openai/harmony, docs/format.md)."""
from __future__ import annotations

import json

import pytest

from kvship.sampling_params import SamplingParams
from kvship.server.harmony import HarmonyStream
from kvship.server.message import MessageShaper
from kvship.server.params import with_reasoning_markers
from kvship.server.protocol import Tool
from kvship.server.tools import ToolPlan

ANSWER = ("<|channel|>analysis<|message|>User asks the capital. Paris.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.")
# a call with the recipient after the channel (and a constraint), a preamble, then a second call
# with the recipient in the role's header, as the format allows both
CALLS = ("<|channel|>analysis<|message|>Need weather for two cities.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
         '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
         '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}')


def run(text: str, tools: bool, pieces: int) -> tuple[str, str, list]:
    """The stream fed ``text`` in pieces of ``pieces`` characters (0: whole), then ended."""
    s = HarmonyStream(tools)
    r, c, calls = [], [], []
    chunks = [text] if pieces == 0 else [text[i:i + pieces] for i in range(0, len(text), pieces)]
    for piece in chunks + [None]:
        out = s.end() if piece is None else s.feed(piece)
        r.append(out[0])
        c.append(out[1])
        calls += out[2]
    return "".join(r), "".join(c), [(x.name, json.loads(x.arguments)) for x in calls]


@pytest.mark.parametrize("pieces", [0, 1, 3])
def test_reasoning_and_answer(pieces):
    assert run(ANSWER, False, pieces) == ("User asks the capital. Paris.", "The capital of France is Paris.", [])
    # the answer closed by <|return|> (when stop tokens are kept) reads the same
    assert run(ANSWER + "<|return|>", False, pieces)[1] == "The capital of France is Paris."


@pytest.mark.parametrize("pieces", [0, 1, 5])
def test_tool_calls(pieces):
    reasoning, content, calls = run(CALLS, True, pieces)
    assert reasoning == "Need weather for two cities."
    assert content == "Checking both."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_calls_without_tools_requested_are_content():
    _, content, calls = run(CALLS, False, 0)
    assert calls == [] and '{"city": "Paris"}' in content


def test_output_not_in_the_format_is_content():
    assert run("Just an answer, no channels.", True, 1) == ("", "Just an answer, no channels.", [])
    assert run("<|channel|>analysis<|message|>cut short", False, 2) == ("cut short", "", [])


def test_message_shaper_builds_the_openai_message():
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}})
    shaper = MessageShaper("harmony", ToolPlan([tool], "auto"))
    msg = shaper.message(CALLS)
    assert msg["reasoning_content"] == "Need weather for two cities." and msg["content"] == "Checking both."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] * 2
    assert shaper.finish_reason("stop") == "tool_calls"
    stream = MessageShaper("harmony", None)
    deltas = [stream.delta(ch) for ch in ANSWER] + [stream.delta("", final=True)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "User asks the capital. Paris."
    assert "".join(d.get("content", "") for d in deltas) == "The capital of France is Paris."
    assert not any("<|" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)


def test_markers_are_kept_in_the_text_for_the_parser():
    params = SamplingParams()
    assert params.skip_special_tokens
    assert not with_reasoning_markers(params, "harmony").skip_special_tokens
    assert with_reasoning_markers(params, "qwen3").skip_special_tokens


def test_harmony_tool_format_parses_without_the_reasoning_parser():
    """A chat template that writes harmony calls (<|call|>) selects the harmony tool format: the
    message is parsed the same without --reasoning-parser, and its markers are kept."""
    from kvship.server.params import with_tool_constraint
    from kvship.server.tool_prompt import _TEMPLATE_MARKS

    assert dict(_TEMPLATE_MARKS)["<|call|>"] == "harmony"
    tool = Tool.model_validate({"type": "function", "function": {"name": "get_weather"}})
    plan = ToolPlan([tool], "auto", parser="harmony")
    msg = MessageShaper(None, plan).message(CALLS)
    assert msg["reasoning_content"] == "Need weather for two cities."
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}, {"city": "Rome"}]
    assert not with_tool_constraint(SamplingParams(), plan).skip_special_tokens


def test_reasoning_effort_reaches_the_chat_template():
    """OpenAI's reasoning_effort (low / medium / high) is passed to the template, which gpt-oss's
    renders as "Reasoning: high"; another value is a validation error, not ignored."""
    import pydantic

    from kvship.server.chat import template_kwargs
    from kvship.server.protocol import ChatCompletionRequest

    ask = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate({"messages": ask, "reasoning_effort": "high",
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert template_kwargs(body, None) == {"enable_thinking": False, "reasoning_effort": "high"}
    assert "reasoning_effort" not in template_kwargs(ChatCompletionRequest.model_validate({"messages": ask}), None)
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate({"messages": ask, "reasoning_effort": "extreme"})
