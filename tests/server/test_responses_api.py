"""POST /v1/responses through the official openai SDK (create, its streaming helper, parse,
function tools, previous_response_id) against a real `kvship serve` of the bundled SmolLM2."""
from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from server_utils import FLOAT32_WEIGHTS, assert_error, start_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


class City(BaseModel):
    name: str = Field(max_length=30)
    population: int = Field(ge=0)


@pytest.fixture(scope="module")
def server():
    # stream against non-stream, a schema closed within max_output_tokens
    srv = start_server("--max-model-len", "1024", "--kv-cache-memory", "512MiB", *FLOAT32_WEIGHTS)
    yield srv
    assert srv.stop() == 0, srv.log()


def test_plain_streamed_and_continued(client, model):
    r = client.responses.create(model=model, input="Say hello in French.", instructions="Be brief.",
                                max_output_tokens=200, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same request streamed: the SDK helper rebuilds the same text from the typed events
    with client.responses.stream(model=model, input="Say hello in French.", instructions="Be brief.",
                                 max_output_tokens=200, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text == r.output_text
    # previous_response_id: the earlier turn is part of the prompt
    more = client.responses.create(model=model, input="And in Spanish?", previous_response_id=r.id,
                                   max_output_tokens=50, temperature=0)
    assert more.previous_response_id == r.id and more.usage.input_tokens > r.usage.input_tokens
    # cut by max_output_tokens: incomplete, saying why
    cut = client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=5, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_structured_output_and_function_tools(client, model):
    parsed = client.responses.parse(model=model, input="Describe Paris.", text_format=City, max_output_tokens=100)
    assert isinstance(parsed.output_parsed, City)
    r = client.responses.create(model=model, input="The weather in Paris?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=80)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(model=model, input="The weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80) as s:
        streamed = [o for o in s.get_final_response().output if o.type == "function_call"]
    assert len(streamed) == 1 and json.loads(streamed[0].arguments)["city"]
    # the tool's result, continuing the stored conversation
    after = client.responses.create(model=model, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
                                    max_output_tokens=30)
    assert after.status in ("completed", "incomplete") and after.output_text


def test_response_mistakes_are_400s(server):
    url = server.url + "/v1/responses"
    cases = [
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": [{"type": "nonsense"}]}, "ANY"),
        ({"input": "x", "max_output_tokens": 0}, "max_tokens"),
    ]
    for body, param in cases:
        assert_error(httpx.post(url, json=body, timeout=60), 400, param)
    # store=false: nothing to continue from
    r = httpx.post(url, json={"input": "hi", "store": False, "max_output_tokens": 3}, timeout=60).json()
    assert_error(httpx.post(url, json={"input": "x", "previous_response_id": r["id"]}, timeout=60), 400,
                 "previous_response_id")


def test_reasoning_streams_as_its_own_item():
    """With a reasoning parser, the thinking streams as a reasoning item (reasoning_text deltas)
    before the message: every event is one the SDK's types accept, and the items equal the
    non-streamed output's. The bundled model never writes <think>, so the engine's outputs are
    made here, cut mid-tag."""
    import asyncio

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from kvship.outputs import CompletionOutput, RequestOutput
    from kvship.server.message import MessageShaper
    from kvship.server.protocol import ResponsesRequest
    from kvship.server.responses_api import ResponseShell, _events, output_items

    pieces = ["<thi", "nk>Two plus", " two is four.</th", "ink>The answer", " is 4."]

    def update(i: int) -> RequestOutput:
        done = i == len(pieces) - 1
        return RequestOutput("r", [1, 2], [CompletionOutput(0, "".join(pieces[:i + 1]), [0] * (i + 1), pieces[i],
                                                            [0], finish_reason="stop" if done else None)])

    async def rest():
        for i in range(1, len(pieces)):
            yield None, update(i)

    async def run() -> list[str]:
        body = ResponsesRequest.model_validate({"input": "2+2?", "store": False})
        return [e async for e in _events(rest(), update(0), ResponseShell("resp_1", body, "m"),
                                         MessageShaper("qwen3", None), 2, None, [])]

    events = [TypeAdapter(ResponseStreamEvent).validate_json(e.split("data: ", 1)[1]) for e in asyncio.run(run())]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two plus two is four."
    final = events[-1].response
    assert final.status == "completed" and final.output_text == "The answer is 4."
    streamed = [{k: v for k, v in i.model_dump(exclude_none=True).items() if k != "id"} for i in final.output]
    whole = output_items({"reasoning_content": "Two plus two is four.", "content": "The answer is 4."})
    assert streamed == [{k: v for k, v in i.items() if k != "id"} for i in whole]
