"""GLM-4.5's tool-call format (parser ``glm45``), as its chat template writes calls:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Values that are not strings are written as JSON (the template's ``tojson``); a string is written
as it is. A value is kept as a string where the tool's schema says the parameter is one, else
read as JSON when it parses, else kept as the string it is. Calls are emitted whole, once their
``</tool_call>`` is generated (server/tools.py ToolStream)."""
from __future__ import annotations

import json
import re

from kvship.server.protocol import Tool

_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _param_type(tools: list[Tool], name: str, key: str) -> object:
    for t in tools:
        if t.function.name == name:
            props = (t.function.parameters or {}).get("properties") or {}
            return (props.get(key) or {}).get("type")
    return None


def glm_call_arguments(body: str, tools: list[Tool]) -> tuple[str, str] | None:
    """(name, arguments JSON) of the text between <tool_call> and </tool_call>; None when it
    names no function."""
    head = body.split("<arg_key>", 1)[0]
    name = head.strip()
    if not name or "\n" in name or "<" in name:
        return None
    args: dict[str, object] = {}
    for key, raw in _PAIR.findall(body[len(head):]):
        key = key.strip()
        if _param_type(tools, name, key) == "string":
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw
    return name, json.dumps(args, ensure_ascii=False)
