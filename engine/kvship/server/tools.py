"""Tool calling for /v1/chat/completions.

What the request asks (`ToolPlan`): `tool_choice` "none" (tools left out of the prompt), "auto"
(the model decides; also what an omitted tool_choice means when tools are given, as in OpenAI's
API), "required" (at least one call, any tool) or a named function. "auto" parses the model's
own call format: the parser given with --tool-call-parser, else the one chosen from the chat
template (server/tool_prompt.py). "required" and named calls are grammar-constrained
(kvship.core.grammar): the arguments are valid JSON matching the function's `parameters` schema
whatever the model is. With the hermes format a single call (named, or "required" without
parallel calls) is generated as the model writes calls itself (a `<tool_call>` block, parsed as
"auto" output is); otherwise a named call's output is the arguments object itself and
"required" outputs a JSON array of {"name", "parameters"} objects.

`ToolStream` turns the generated text, delta by delta, into content and tool calls, streamed as
OpenAI streams them: a call's id and name first, then its arguments piece by piece. A named
call's output is its arguments; in every other format (hermes, llama3_json, mistral, the
"required" array) a call whose text starts `{"name": "<a declared tool>", "arguments": ` (the
usual order) streams the same way; a call object in another shape is emitted whole once it is
complete.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

from kvship.core.grammar import canonical_json, check_schema
from kvship.core.stop import held_back
from kvship.sampling_params import StructuredOutput
from kvship.server.errors import bad_request
from kvship.server.glm_tools import glm_call_arguments
from kvship.server.protocol import ChatCompletionRequest, Tool

NO_ARGUMENTS = {"type": "object", "properties": {}}

# The head of a call object whose arguments can be streamed as they are generated.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolPlan:
    tools: list[Tool]
    mode: str  # "auto" | "required" | "named"
    name: str | None = None  # the function a named choice forces
    parallel: bool = True
    parser: str | None = None  # the model's own call format; None: none known (calls constrained as bare JSON)

    @property
    def native(self) -> bool:
        """Whether a constrained call is generated in the model's own format (hermes): a named
        call, or "required" without parallel calls. Several calls stay a JSON array, whose "]"
        is a plain place to stop: after a </tool_call> a weak model tended to call again."""
        return self.parser == "hermes" and self.mode != "auto" and (self.mode == "named" or not self.parallel)

    def template_tools(self) -> list[dict[str, object]]:
        """The tools as chat templates read them (transformers passes the same shape)."""
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        """The grammar a required or named call is generated under (None for "auto")."""
        if self.mode == "auto":
            return None
        tools = [t for t in self.tools if self.mode == "required" or t.function.name == self.name]
        if self.native:
            return self._hermes_constraint(tools)
        if self.mode == "named":
            return StructuredOutput("json", canonical_json(tools[0].function.parameters or NO_ARGUMENTS), param="tools")
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters or NO_ARGUMENTS},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", canonical_json(schema), param="tools")

    def _hermes_constraint(self, tools: list[Tool]) -> StructuredOutput:
        """One `<tool_call>` block, `{"name": <a tool>, "arguments": <its schema>}`."""
        tags = []
        for t in tools:
            schema = t.function.parameters or NO_ARGUMENTS
            check_schema(schema, "tools")  # the structural tag is not checked as a "json" spec is
            # one whitespace at most between JSON tokens: arguments as models write them, and a
            # weak model cannot run on in blanks
            tags.append({"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(t.function.name)}, "arguments": ',
                         "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                         "end": "}\n</tool_call>"})
        fmt = {"type": "or", "elements": tags}
        return StructuredOutput("structural_tag", canonical_json({"type": "structural_tag", "format": fmt}),
                                param="tools")


def tool_plan(body: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """What the request's tool fields ask for (None: no tools in play). `parser`: the model's
    call format (server/tool_prompt.tool_format); None: none known, "auto" reads hermes calls."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice names a tool call, but no tools were given.", param="tool_choice")
        return None
    parallel = body.parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice is None or choice == "auto":  # omitted with tools given: "auto", as in OpenAI's API
        return ToolPlan(body.tools, "auto", parallel=parallel, parser=parser or "hermes")
    if choice == "required":
        return ToolPlan(body.tools, "required", parallel=parallel, parser=parser)
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)}).", param="tool_choice")
    return ToolPlan(body.tools, "named", name=choice.function.name, parallel=parallel, parser=parser)


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


class _CallScanner:
    """Tool calls in JSON text that is still being generated: one object, an array of objects,
    or objects separated by ";" (llama3_json). An object that starts `{"name": "<a declared
    tool>", "arguments": ` (or "parameters") streams: its name, then its arguments as they are
    written, ending exactly where the JSON value ends; an object in any other shape comes whole
    once it is complete. ``scan`` takes the whole text so far (it only grows) and returns
    events: ("open", name), ("args", piece), ("whole", object text)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.pos = 0  # where scanning goes on
        self.obj: int | None = None  # where the object being read starts
        self.args: int | None = None  # where its streamed arguments start
        self.args_done = False
        self.sent = 0  # characters of the arguments sent
        self.nesting = _Nesting()  # inside the arguments
        self.stopped = False  # text that is not a call: nothing more is read

    def scan(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        while not self.stopped:
            if self.obj is None:  # between objects
                i = self.pos
                while i < len(text) and text[i] in " \t\r\n,;[]":
                    i += 1
                self.pos = i
                if i == len(text):
                    break
                if text[i] != "{":
                    self.stopped = True
                    break
                self.obj = i
            if self.args is None:
                head = _CALL_HEAD.match(text, self.obj)
                # complete once a character follows it (until then its trailing spaces may grow)
                if head is not None and head.end() < len(text) and head.group(1) in self.names:
                    events.append(("open", head.group(1)))
                    self.args = self.pos = head.end()
                    continue
                end = _object_end(text, self.obj)
                if end is None:
                    break
                events.append(("whole", text[self.obj:end]))
                self.obj, self.pos = None, end
                continue
            if not self.args_done:
                stop = self._value_end(text)
                value = text[self.args:len(text) if stop is None else stop].rstrip()
                if len(value) > self.sent:
                    events.append(("args", value[self.sent:]))
                    self.sent = len(value)
                if stop is None:
                    break
                self.args_done = True
            end = _object_end(text, self.obj)  # keys after the arguments are read past
            if end is None:
                break
            self.obj, self.args, self.args_done, self.sent, self.pos = None, None, False, 0, end
            self.nesting = _Nesting()
        return events

    def _value_end(self, text: str) -> int | None:
        """Where the arguments' JSON value ends (the "," or "}" after it), reading on from
        self.pos; None while it has not ended."""
        for i in range(self.pos, len(text)):
            if self.nesting.step(text[i]) == 0 and text[i] in ",}]":
                self.pos = i
                return i
        self.pos = len(text)
        return None


class _Nesting:
    """Where JSON text stands, a character at a time: inside a string (escapes followed) or at
    a depth of brackets."""

    def __init__(self):
        self.depth, self.in_str, self.esc = 0, False, False

    def step(self, c: str) -> int | None:
        """Takes the next character: the depth it stands at, None inside a string."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
            return None
        if c == '"':
            self.in_str = True
            return None
        depth = self.depth
        self.depth += (c in "{[") - (c in "}]")
        return depth


def _object_end(text: str, start: int) -> int | None:
    """The index after the "}" that closes the object opening at text[start]; None if it has
    not closed yet."""
    nesting = _Nesting()
    for i in range(start, len(text)):
        if nesting.step(text[i]) == 1 and text[i] in "}]":
            return i + 1
    return None


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
        # "named" / "required": the bare JSON a constraint without a model format writes;
        # "parsed": the model's own format (auto, and constrained calls in the hermes format)
        self._form = "parsed" if plan.mode == "auto" or plan.native else plan.mode
        if self._form == "named":
            self.calls.append(Call(plan.name, ""))
        self._named_started = False
        self._scanner: _CallScanner | None = None  # the calls of the current region (a hermes tag, the output)
        self._region_first_call = 0
        self._after_call, self._blanks = False, ""  # hermes: blanks after a call, held back

    # -- streaming
    def feed(self, text: str) -> tuple[str, list[dict[str, object]]]:
        mode = self._form
        if mode == "named":
            return "", self._named(text)
        self._buf += text
        if mode == "required":
            return "", self._scan(self._buf)
        if self.plan.parser == "hermes":
            return self._hermes(final=False)
        if self.plan.parser == "glm45":
            return self._glm45(final=False)
        return self._prefixed(final=False)

    def end(self) -> tuple[str, list[dict[str, object]]]:
        mode = self._form
        if mode == "named":
            return "", self._named("") if not self._named_started else []
        if mode == "required":
            deltas = self._scan(self._buf)
            return ("", deltas) if self.calls else (self._buf, [])
        if self.plan.parser == "hermes":
            return self._hermes(final=True)
        if self.plan.parser == "glm45":
            return self._glm45(final=True)
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

    def _scan(self, region: str) -> list[dict[str, object]]:
        """Deltas for the calls in `region` (the text of the current region so far)."""
        if self._scanner is None:
            self._scanner = _CallScanner({t.function.name for t in self.plan.tools})
            self._region_first_call = len(self.calls)
        deltas: list[dict[str, object]] = []
        for kind, value in self._scanner.scan(region):
            if kind == "open":
                deltas += self._emit([Call(value, "")])[1]
            elif kind == "args":
                self.calls[-1].arguments += value
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": value}})
            else:
                whole = _json_calls(value)
                if whole is None:  # not a call: neither is what follows
                    self._scanner.stopped = True
                else:
                    deltas += self._emit(whole)[1]
        return deltas

    def _region_had_calls(self) -> bool:
        """At a region's end: whether it held a call (else its text is content); the next
        region gets a scanner of its own."""
        self._scanner = None
        return len(self.calls) > self._region_first_call

    def _text(self, piece: str) -> str:
        """Content text of the hermes format: blanks after a call (the line breaks between
        calls) are held back, and dropped unless more text follows them."""
        if not self._after_call:
            return piece
        self._blanks += piece
        if not self._blanks.strip():
            return ""
        out, self._blanks, self._after_call = self._blanks, "", False
        return out

    def _hermes(self, final: bool) -> tuple[str, list[dict[str, object]]]:
        content, deltas = "", []
        while True:
            start = self._buf.find(self.HERMES_START)
            if start < 0:
                # keep back what could be the start of a tag
                keep = 0 if final else held_back(self._buf, [self.HERMES_START])
                content += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return content, deltas
            content += self._text(self._buf[:start])
            self._buf = self._buf[start:]  # from here on the region's text only grows
            end = self._buf.find(self.HERMES_END)
            body = self._buf[len(self.HERMES_START):end if end >= 0 else None]
            if end < 0 and not final:
                return content, deltas + self._scan(body[:len(body) - held_back(body, [self.HERMES_END])])
            region = self._scan(body)
            if self._region_had_calls():
                deltas += region
                self._after_call = True
            else:  # not a call after all: the text stays text
                content += self._text(self._buf[:end + len(self.HERMES_END) if end >= 0 else None])
            self._buf = self._buf[end + len(self.HERMES_END):] if end >= 0 else ""
            if end < 0:
                return content, deltas

    def _glm45(self, final: bool) -> tuple[str, list[dict[str, object]]]:
        """GLM's `<tool_call>name<arg_key>..` blocks (server/glm_tools.py), each emitted whole
        once closed; a block that names no function stays text."""
        content, deltas = "", []
        start_tag, end_tag = self.HERMES_START, self.HERMES_END
        while True:
            start = self._buf.find(start_tag)
            if start < 0:
                keep = 0 if final else held_back(self._buf, [start_tag])
                content += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return content, deltas
            content += self._text(self._buf[:start])
            self._buf = self._buf[start:]
            end = self._buf.find(end_tag)
            if end < 0 and not final:
                return content, deltas
            call = None if end < 0 else glm_call_arguments(self._buf[len(start_tag):end], self.plan.tools)
            if call is None:
                content += self._text(self._buf if end < 0 else self._buf[:end + len(end_tag)])
            else:
                deltas += self._emit([Call(*call)])[1]
                self._after_call = True
            self._buf = "" if end < 0 else self._buf[end + len(end_tag):]
            if end < 0:
                return content, deltas

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
        region = self._buf.lstrip().removeprefix(self.LLAMA_PREFIX).removeprefix(self.MISTRAL_START)
        deltas = self._scan(region)
        if not final:
            return "", deltas
        return ("", deltas) if self._region_had_calls() else (self._buf, [])
