"""Which tool-call format a model is served with, and kvship's tool prompt for chat templates
that cannot show tools (docs/tools.md).

`tool_format`: the parser that reads the model's own calls under tool_choice "auto" is the one
given (--tool-call-parser), else the one the chat template's tool format names (`<tool_call>`:
hermes, `<arg_key>` beside it: glm45, `[TOOL_CALLS]`: mistral, `<|python_tag|>` / ipython:
llama3_json), else hermes. Decided once per tokenizer and logged.

Whether the template can show tools is found by rendering a probe conversation (tool
definitions, an assistant call, a tool result) and looking for each in the text: plain ChatML
templates such as SmolLM2's drop the tools and render a call as an empty turn. Such a template
gets `with_tool_prompt`: a hermes-style system prompt listing the tools (the text Qwen2.5's
template writes), earlier calls written into the assistant's content as `<tool_call>` blocks,
and tool results as user turns in `<tool_response>` blocks; the model then calls in the
hermes format, which is parsed.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache

from kvship.loader.tokenizer import Tokenizer

logger = logging.getLogger("kvship.server")

DEFAULT_PARSER = "hermes"

# Marks of a template's own call format, in the order they are looked for.
_TEMPLATE_MARKS = (("<|call|>", "harmony"), ("<arg_key>", "glm45"), ("<tool_call>", "hermes"),
                   ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))

TOOL_PROMPT_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOL_PROMPT_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

_PROBE_NAME, _PROBE_VALUE, _PROBE_RESULT = "kvship_probe_fn", "kvship_probe_value", "kvship_probe_result"
_PROBE_ID = "kvprobe01"  # nine letters and digits: Mistral's templates refuse other call ids
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
_PROBE_USER = {"role": "user", "content": "probe"}
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [{
    "id": _PROBE_ID, "type": "function", "function": {"name": _PROBE_NAME, "arguments": {"q": _PROBE_VALUE}}}]}
_PROBE_TOOL_RESULT = {"role": "tool", "tool_call_id": _PROBE_ID, "content": _PROBE_RESULT}


@dataclass(frozen=True)
class ToolFormat:
    parser: str  # the call format "auto" parses (and "required"/named are generated in, for hermes)
    # where the parser came from: "--tool-call-parser", "chat template", "tool prompt" (kvship's,
    # which asks for hermes calls) or "default" (a template whose tool format is not known)
    source: str
    injected: bool  # the template cannot show tools: kvship's tool prompt stands in for it

    def card(self) -> dict[str, str]:
        """What /v1/models says of it."""
        return {"parser": self.parser, "parser_source": self.source,
                "prompt": "kvship" if self.injected else "chat_template"}


def _renders(tokenizer: Tokenizer, messages: list[dict], needle: str, **kwargs: object) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that fails on the probe cannot show tools
        return False
    return isinstance(text, str) and needle in text


@lru_cache(maxsize=8)
def template_shows_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders tool definitions, an assistant's calls and tool results
    (probed once per tokenizer)."""
    if not tokenizer.chat_template:
        return False
    return (_renders(tokenizer, [_PROBE_USER], _PROBE_NAME, tools=_PROBE_TOOLS)
            and _renders(tokenizer, [_PROBE_USER, _PROBE_CALL], _PROBE_VALUE, tools=_PROBE_TOOLS)
            and _renders(tokenizer, [_PROBE_USER, _PROBE_CALL, _PROBE_TOOL_RESULT], _PROBE_RESULT, tools=_PROBE_TOOLS))


@lru_cache(maxsize=8)
def tool_format(tokenizer: Tokenizer, configured: str | None = None) -> ToolFormat:
    """The format tools are served in for this tokenizer's template; `configured`: the
    --tool-call-parser given (None: chosen here). Logged once."""
    shows = template_shows_tools(tokenizer)
    if configured is not None:
        fmt = ToolFormat(configured, "--tool-call-parser", not shows)
    else:
        template = tokenizer.chat_template or ""
        found = next((parser for mark, parser in _TEMPLATE_MARKS if shows and mark in template), None)
        source = "chat template" if found else "tool prompt" if not shows else "default"
        fmt = ToolFormat(found or DEFAULT_PARSER, source, not shows)
    if fmt.injected:
        logger.info("tool calls: the chat template cannot show tools; kvship's tool prompt stands in for it "
                    "(parser %s, from %s)", fmt.parser, fmt.source)
    else:
        logger.info("tool calls: the chat template shows tools; parser %s (from %s)", fmt.parser, fmt.source)
    return fmt


def tool_prompt(tools: list[dict]) -> str:
    """The tool-use system prompt: each tool's definition as JSON, then how to call."""
    return TOOL_PROMPT_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOL_PROMPT_TAIL


def _call_text(call: dict) -> str:
    fn = call.get("function") or {}
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                        ensure_ascii=False) + "\n</tool_call>"


def with_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` (as templates read them) rewritten for a template that cannot show tools: the
    tool prompt after the system message's own text (or as the system message), each
    assistant call as a `<tool_call>` block in its content, consecutive tool results as one
    user turn of `<tool_response>` blocks."""
    out: list[dict] = []
    after_result = False  # the last turn written holds tool results
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
            continue
        after_result = False
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{calls}" if content else calls
        out.append(m)
    if tools:
        prompt = tool_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0]
            out[0] = {**first, "content": f"{first.get('content')}\n\n{prompt}" if first.get("content") else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
