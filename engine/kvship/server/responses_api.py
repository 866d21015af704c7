"""POST /v1/responses: OpenAI's Responses API over the chat path. The request (input text or
items, instructions, function tools, text.format, the conversation of `previous_response_id`)
becomes chat messages and a ChatCompletionRequest, so that sampling, tools, structured output
and the chat template are checked and applied exactly as for /v1/chat/completions; the output
comes back as Responses output items, whole or as the typed `response.*` stream events.

Stored responses (store, the default) keep their conversation in a bounded in-memory store
(ServerState.responses) for `previous_response_id`; an evicted or unknown id is a 400."""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kvship.outputs import RequestOutput
from kvship.server.body import accept
from kvship.server.chat import template_kwargs
from kvship.server.errors import SafeJSONResponse, bad_request, utf8_safe, validation_error
from kvship.server.generation import ClientDisconnected, GenerationStream, final_outputs, first_output
from kvship.server.message import MessageShaper
from kvship.server.metrics import observe_request
from kvship.server.params import (
    fit_to_context,
    prepare_grammar,
    sampling_params,
    with_reasoning_markers,
    with_tool_constraint,
)
from kvship.server.prompts import chat_prompt_ids, chat_size, check_text_fits, run_tokenizer
from kvship.server.protocol import ChatCompletionRequest, ChatMessage, ResponseMessageItem, ResponsesRequest
from kvship.server.sse import sse_response
from kvship.server.state import ServerState
from kvship.server.tool_prompt import tool_format
from kvship.server.tools import tool_plan

router = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages: function calls become an assistant message's
    tool_calls (consecutive calls in one message), their outputs tool messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, ResponseMessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    d: dict[str, Any] = {"messages": messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
                         "top_p": body.top_p, "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        d["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}
                      for t in body.tools]
    if isinstance(body.tool_choice, str):
        d["tool_choice"] = body.tool_choice
    elif body.tool_choice is not None:
        d["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    if body.reasoning is not None:
        if body.reasoning.summary is not None or body.reasoning.generate_summary is not None:
            raise bad_request("reasoning.summary is not supported: the reasoning comes back whole, as reasoning "
                              "text, not summarized.", param="reasoning.summary")
        d["reasoning_effort"] = body.reasoning.effort
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        d["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs `schema`.", param="text.format")
        d["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
    try:
        return ChatCompletionRequest.model_validate(d)
    except ValidationError as exc:  # e.g. a message list a previous response left invalid
        raise validation_error([dict(e, loc=("body", *e.get("loc", ()))) for e in exc.errors()]) from None


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (MessageShaper.message) as Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(_message_item(_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                                "completed"))
    return items


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status, "content": content}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseShell:
    """The response object around the output, as the API returns it in every state."""

    def __init__(self, response_id: str, body: ResponsesRequest, model: str):
        self.id, self.body, self.model = response_id, body, model
        self.created = int(time.time())

    def json(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             incomplete: str | None = None) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        tool_choice = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) \
            else (b.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "temperature": b.temperature, "top_p": b.top_p,
            "tool_choice": tool_choice,
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in b.tools or []],
            "text": {"format": fmt}, "truncation": "disabled", "store": b.store is not False,
            "metadata": b.metadata or {}, "user": b.user, "usage": usage,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
        }


def usage_json(out: RequestOutput, prompt_len: int) -> dict[str, Any]:
    n_in = len(out.prompt_token_ids) if out.prompt_token_ids else prompt_len
    n_out = sum(len(c.token_ids) for c in out.outputs)
    cached = out.num_cached_tokens or 0  # served from the prefix cache; the rest were computed and stored
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": n_in - cached},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


@router.post("/v1/responses")
async def create_response(raw_request: Request) -> Response:
    arrival = time.monotonic()
    body, state, engine = await accept(raw_request, ResponsesRequest)
    if not body.input:  # "" or []: refused here, or the chat request's check would name `messages`
        raise bad_request("`input` must not be empty.", param="input", code="invalid_value")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = state.responses.get(body.previous_response_id)
        if history is None:
            raise bad_request(f"Previous response with id '{body.previous_response_id}' not found (unknown, not "
                              "stored, or evicted from this server's store).", param="previous_response_id",
                              code="previous_response_not_found")
    conversation = history + input_messages(body)
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []  # not carried on
    chat = chat_request(body, head + conversation)
    params = sampling_params(chat, engine)
    plan = tool_plan(chat, tool_format(engine.tokenizer, state.tool_call_parser).parser)
    params = with_tool_constraint(params, plan)
    params = with_reasoning_markers(params, state.reasoning_parser)
    await prepare_grammar(params, engine)
    check_text_fits(engine.tokenizer, chat_size(chat.messages), engine.max_model_len, "input")
    prompt_ids = await run_tokenizer(chat_prompt_ids, engine.tokenizer, chat.messages, True, template_kwargs(chat, plan),
                                     size=chat_size(chat.messages))
    params = fit_to_context(params, [len(prompt_ids)], engine.max_model_len, "input")

    shell = ResponseShell(_id("resp"), body, engine.model_name)
    observer = observe_request(raw_request, shell.id, params)
    state.admission.reserve(engine, 1)
    stream = GenerationStream(engine, [prompt_ids], params, shell.id, state.active, observer, state.admission,
                              arrival_time=arrival, final_only=not body.stream)
    shaper = MessageShaper(state.reasoning_parser, plan)
    if body.stream:
        try:
            _, first = await first_output(raw_request, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        events = _events(stream, first, shell, shaper, len(prompt_ids), state, conversation)
        return sse_response(stream, shell.id, events)
    try:
        (final,) = await final_outputs(raw_request, stream, 1)
    except ClientDisconnected:
        return Response(status_code=499)
    await stream.aclose()
    choice = final.outputs[0]
    message = shaper.message(choice.text)
    _store(state, shell, conversation, message)
    incomplete = {"length": "max_output_tokens", "error": "grammar_error"}.get(choice.finish_reason)  # error: a dead end
    return SafeJSONResponse(shell.json("incomplete" if incomplete else "completed", output_items(message),
                                       usage_json(final, len(prompt_ids)), incomplete))


def _store(state: ServerState, shell: ResponseShell, conversation: list[dict[str, Any]],
           message: dict[str, Any]) -> None:
    if shell.body.store is False:
        return
    reply = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    ChatMessage.model_validate(reply)  # what a later request will send through the same model
    state.responses.put(shell.id, conversation + [reply])


def _message_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message that streamed items make up (what previous_response_id continues from)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return {"content": text or None, "tool_calls": calls or None}


def _event(kind: str, seq: int, **fields: Any) -> str:
    data = utf8_safe(json.dumps({"type": kind, "sequence_number": seq, **fields}, ensure_ascii=False,
                                separators=(",", ":")))
    return f"event: {kind}\ndata: {data}\n\n"


async def _events(stream: GenerationStream, first: RequestOutput, shell: ResponseShell, shaper: MessageShaper,
                  prompt_len: int, state: ServerState, conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The typed stream: response.created / in_progress, then per output item its added event,
    deltas and done events, then response.completed (or response.incomplete)."""
    seq = 0
    items: list[dict[str, Any]] = []  # finished items, in output order
    open_item: dict[str, Any] | None = None  # the item receiving deltas
    text = ""

    def emit(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    def close() -> list[str]:
        nonlocal open_item, text
        if open_item is None:
            return []
        idx, out = len(items), []
        if open_item["type"] == "message":
            part = _text_part(text)
            out += [emit("response.output_text.done", item_id=open_item["id"], output_index=idx, content_index=0,
                         text=text, logprobs=[]),
                    emit("response.content_part.done", item_id=open_item["id"], output_index=idx, content_index=0,
                         part=part)]
            done = _message_item(open_item["id"], text, "completed")
        elif open_item["type"] == "reasoning":
            out.append(emit("response.reasoning_text.done", item_id=open_item["id"], output_index=idx, content_index=0,
                            text=text))
            done = _reasoning_item(open_item["id"], text, "completed")
        else:
            out.append(emit("response.function_call_arguments.done", item_id=open_item["id"], output_index=idx,
                            arguments=open_item["arguments"]))
            done = {**open_item, "status": "completed"}
        out.append(emit("response.output_item.done", output_index=idx, item=done))
        items.append(done)
        open_item, text = None, ""
        return out

    def on_delta(delta: dict[str, Any]) -> list[str]:
        nonlocal open_item, text
        out: list[str] = []
        thought = delta.get("reasoning_content")
        if thought:  # the reasoning parser's share comes first, as its own item
            if open_item is None or open_item["type"] != "reasoning":
                out += close()
                open_item = _reasoning_item(_id("rs"), None, "in_progress")
                out.append(emit("response.output_item.added", output_index=len(items), item=open_item))
            text += thought
            out.append(emit("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(items),
                            content_index=0, delta=thought))
        content = delta.get("content")
        if content:
            if open_item is None or open_item["type"] != "message":
                out += close()
                open_item = _message_item(_id("msg"), None, "in_progress")
                out += [emit("response.output_item.added", output_index=len(items), item=open_item),
                        emit("response.content_part.added", item_id=open_item["id"], output_index=len(items),
                             content_index=0, part=_text_part(""))]
            text += content
            out.append(emit("response.output_text.delta", item_id=open_item["id"], output_index=len(items),
                            content_index=0, delta=content, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function", {})
            if "id" in call:  # a new call
                out += close()
                open_item = _call_item(_id("fc"), call["id"], fn.get("name", ""), "", "in_progress")
                out.append(emit("response.output_item.added", output_index=len(items), item=open_item))
            if fn.get("arguments") and open_item is not None:
                open_item["arguments"] += fn["arguments"]
                out.append(emit("response.function_call_arguments.delta", item_id=open_item["id"],
                                output_index=len(items), delta=fn["arguments"]))
        return out

    yield emit("response.created", response=shell.json("in_progress", []))
    yield emit("response.in_progress", response=shell.json("in_progress", []))
    out: RequestOutput | None = first
    last = first
    while out is not None:
        last = out
        c = out.outputs[0]
        for e in on_delta(shaper.delta(c.text_delta) if c.text_delta else {}):
            yield e
        if c.finish_reason is not None:
            for e in on_delta(shaper.delta("", final=True)) + close():
                yield e
            break
        try:
            _, out = await stream.__anext__()
        except StopAsyncIteration:
            out = None
    choice = last.outputs[0]
    incomplete = {"length": "max_output_tokens", "error": "grammar_error"}.get(choice.finish_reason)  # error: a dead end
    _store(state, shell, conversation, _message_of(items))
    final = shell.json("incomplete" if incomplete else "completed", items, usage_json(last, prompt_len), incomplete)
    yield emit("response.incomplete" if incomplete else "response.completed", response=final)
