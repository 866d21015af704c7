"""Tool calling for /v1/chat/completions.

What the request asks (`ToolPlan`): `tool_choice` "none" (tools left out of the prompt), "auto"
(the model decides; its own call format is parsed by the parser the server was started with,
--tool-call-parser), "required" (at least one call, any tool) or a named function. "required"
and named calls are grammar-constrained (kvship.core.grammar): the arguments are valid JSON
matching the function's `parameters` schema whatever the model is. A named call's output is the
arguments object itself; "required" outputs a JSON array of {"name", "parameters"} objects.

`ToolStream` turns the generated text, delta by delta, into content and tool calls: a named
call streams its arguments piece by piece, and so does a hermes call once its text has shown
`{"name": "<a declared tool>", "arguments":` (the usual order); other calls (a "required"
array, llama3_json, mistral, a hermes body in another shape) are emitted whole as soon as each
one is complete (OpenAI's stream format allows both, and the SDKs reassemble either).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from kvship.core.grammar import canonical_json
from kvship.core.stop import held_back
from kvship.sampling_params import StructuredOutput
from kvship.server.errors import bad_request
from kvship.server.protocol import ChatCompletionRequest, Tool

NO_ARGUMENTS = {"type": "object", "properties": {}}

# The head of a call object whose arguments can be streamed as they are generated.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# What closes the call object after its arguments: held back until the call's end shows it.
_CALL_TAIL = re.compile(r'\s*\}?\s*$')


@dataclass
class ToolPlan:
    tools: list[Tool]
    mode: str  # "auto" | "required" | "named"
    name: str | None = None  # the function a named choice forces
    parallel: bool = True
    parser: str | None = None  # the model's own call format ("auto")

    def template_tools(self) -> list[dict[str, object]]:
        """The tools as chat templates read them (transformers passes the same shape)."""
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        """The grammar a required or named call is generated under (None for "auto")."""
        if self.mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutput("json", canonical_json(fn.parameters or NO_ARGUMENTS), param="tools")
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                       "parameters": t.function.parameters or NO_ARGUMENTS},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput("json", canonical_json(schema), param="tools")
        return None


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """What the request's tool fields ask for (None: no tools in play). `parser`: the server's
    --tool-call-parser, None unless --enable-auto-tool-choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice names a tool call, but no tools were given.", param="tool_choice")
        return None
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser; or ask for "required" or a named function, which are '
                              "grammar-constrained and need neither.", param="tool_choice")
        return ToolPlan(body.tools, "auto", parallel=parallel, parser=parser)
    if choice == "required":
        return ToolPlan(body.tools, "required", parallel=parallel)
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)}).", param="tool_choice")
    return ToolPlan(body.tools, "named", name=choice.function.name, parallel=parallel)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _json_calls(text: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[Call] | None:
    """Calls from a JSON object or array of objects; None if the text is not that."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, args_keys) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


class ToolStream:
    """Generated text in, (content delta, tool-call deltas) out. A tool-call delta is the dict
    of OpenAI's `delta.tool_calls` entry, `index` included."""

    HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
    MISTRAL_START = "[TOOL_CALLS]"
    LLAMA_PREFIX = "<|python_tag|>"

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls: list[Call] = []
        self._buf = ""
        self._tool_mode: bool | None = None  # llama3_json / mistral: decided from the first characters
        if plan.mode == "named":
            self.calls.append(Call(plan.name, ""))
        self._named_started = False
        self._open: tuple[int, int] | None = None  # hermes call streaming: (where its arguments start, sent)

    # -- streaming
    def feed(self, text: str) -> tuple[str, list[dict[str, object]]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._named(text)
        self._buf += text
        if mode == "required":
            return "", []  # one JSON array: complete at the end
        if self.plan.parser == "hermes":
            return self._hermes(final=False)
        return self._prefixed(final=False)

    def end(self) -> tuple[str, list[dict[str, object]]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._named("") if not self._named_started else []
        if mode == "required":
            calls = _json_calls(self._buf, ("parameters", "arguments")) or []
            return self._emit(calls) if calls else (self._buf, [])
        if self.plan.parser == "hermes":
            return self._hermes(final=True)
        return self._prefixed(final=True)

    # -- per format
    def _named(self, text: str) -> list[dict[str, object]]:
        call = self.calls[0]
        call.arguments += text
        if not self._named_started:
            self._named_started = True
            return [{"index": 0, **call.json()}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _emit(self, calls: list[Call]) -> tuple[str, list[dict[str, object]]]:
        start = len(self.calls)
        self.calls += calls
        return "", [{"index": start + i, **c.json()} for i, c in enumerate(calls)]

    def _hermes(self, final: bool) -> tuple[str, list[dict[str, object]]]:
        content, deltas = "", []
        while True:
            start = self._buf.find(self.HERMES_START)
            if start < 0:
                # keep back what could be the start of a tag
                keep = 0 if final else held_back(self._buf, [self.HERMES_START])
                content += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return content, deltas
            content += self._buf[:start]
            end = self._buf.find(self.HERMES_END, start)
            body_at = start + len(self.HERMES_START)
            if end < 0 and not final:
                self._buf = self._buf[start:]
                body = self._buf[len(self.HERMES_START):]
                return content, deltas + self._stream_arguments(body[:len(body) - held_back(body, [self.HERMES_END])])
            body = self._buf[body_at:end if end >= 0 else None]
            if self._open is not None:  # its arguments end before the object's closing brace
                args = _CALL_TAIL.sub("", body[self._open[0]:], count=1)
                deltas += self._more_arguments(args)
                self._open = None
            else:
                calls = _json_calls(body.strip())
                if calls is None:  # not a call after all: the text stays text
                    content += self._buf[start:end + len(self.HERMES_END) if end >= 0 else None]
                else:
                    deltas += self._emit(calls)[1]
            self._buf = self._buf[end + len(self.HERMES_END):] if end >= 0 else ""
            if end < 0:
                return content, deltas

    def _stream_arguments(self, body: str) -> list[dict[str, object]]:
        """Deltas for a hermes call still being generated: its name once the head is complete
        and names a declared tool (sent with the arguments' first character), then its arguments as they grow, less a possible closing
        brace of the object (the end tag decides)."""
        if self._open is None:
            head = _CALL_HEAD.match(body)
            # complete once a character follows it (until then the spaces it ends with may grow)
            if head is None or head.end() == len(body) or head.group(1) not in {t.function.name for t in self.plan.tools}:
                return []
            self._open = (head.end(), 0)
            return self._emit([Call(head.group(1), "")])[1] + self._stream_arguments(body)
        return self._more_arguments(_CALL_TAIL.sub("", body[self._open[0]:], count=1))

    def _more_arguments(self, args: str) -> list[dict[str, object]]:
        at, sent = self._open
        self._open = (at, len(args))
        self.calls[-1].arguments = args
        piece = args[sent:]
        return [{"index": len(self.calls) - 1, "function": {"arguments": piece}}] if piece else []

    def _prefixed(self, final: bool) -> tuple[str, list[dict[str, object]]]:
        """llama3_json (a JSON call, or several separated by ";", maybe after <|python_tag|>)
        and mistral ([TOOL_CALLS] then a JSON array): calls only when the output starts so."""
        if self._tool_mode is None:
            head = self._buf.lstrip()
            marks = ((self.LLAMA_PREFIX, "{") if self.plan.parser == "llama3_json" else (self.MISTRAL_START,))
            if any(head.startswith(m) for m in marks):
                self._tool_mode = True
            elif any(m.startswith(head) for m in marks) and not final:
                return "", []  # could still become a call
            else:
                self._tool_mode = False
        if not self._tool_mode:
            out, self._buf = self._buf, ""
            return out, []
        if not final:
            return "", []
        text = self._buf.strip()
        if self.plan.parser == "mistral":
            calls = _json_calls(text[len(self.MISTRAL_START):].strip())
        else:
            text = text.removeprefix(self.LLAMA_PREFIX)
            parts = [_json_calls(p.strip()) for p in text.split(";") if p.strip()]
            calls = [c for p in parts for c in p] if parts and all(p is not None for p in parts) else None
        if calls is None:
            return self._buf, []
        return self._emit(calls)
