"""A request's output constraint, from whichever field asked for it: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` object, or vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one may be given; the engine compiles
it with xgrammar (kvship.core.grammar), which refuses with a 400 what it cannot serve."""
from __future__ import annotations

import json

from kvship.core.grammar import canonical_json
from kvship.sampling_params import StructuredOutput
from kvship.server.errors import bad_request
from kvship.server.protocol import ChatCompletionRequest, CompletionRequest


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    found: list[StructuredOutput] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json_object", param="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs `json_schema.schema`.",
                              param="response_format")
        found.append(_json(rf.json_schema.schema_, "response_format"))
    so = body.structured_outputs
    if so is not None:
        given = [k for k in ("json_", "regex", "choice", "grammar", "structural_tag") if getattr(so, k) is not None]
        given += ["json_object"] if so.json_object else []
        if len(given) != 1:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object, "
                              f"structural_tag; got {', '.join(k.rstrip('_') for k in given) or 'none'}.",
                              param="structured_outputs")
        kind = given[0]
        if kind == "json_":
            found.append(_json(so.json_, "structured_outputs"))
        elif kind == "json_object":
            found.append(StructuredOutput("json_object", param="structured_outputs"))
        elif kind == "choice":
            found.append(_choice(so.choice, "structured_outputs"))
        else:
            found.append(StructuredOutput(kind, getattr(so, kind), param="structured_outputs"))
    if body.guided_json is not None:
        found.append(_json(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        found.append(StructuredOutput("regex", body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        found.append(_choice(body.guided_choice, "guided_choice"))
    if body.guided_grammar is not None:
        found.append(StructuredOutput("grammar", body.guided_grammar, param="guided_grammar"))
    if len(found) > 1:
        raise bad_request(f"Only one output constraint may be given; got {', '.join(s.param for s in found)}.",
                          param=found[1].param)
    return found[0] if found else None


def _json(schema: object, param: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request("The JSON schema is not valid JSON.", param=param) from None
    if schema is True or schema == {}:
        return StructuredOutput("json_object", param=param)  # no constraint beyond "JSON"
    if not isinstance(schema, dict):
        raise bad_request("The JSON schema must be a JSON object.", param=param)
    return StructuredOutput("json", canonical_json(schema), param=param)


def _choice(choices: list[str] | None, param: str) -> StructuredOutput:
    if not choices:
        raise bad_request("A choice constraint needs at least one choice.", param=param)
    return StructuredOutput("choice", json.dumps(choices, ensure_ascii=False), param=param)
