"""POST /v1/chat/completions: chat template, then one engine request with n choices; answered as
one JSON body or as Server-Sent Events in OpenAI's chunk format."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvship.outputs import RequestOutput, TokenLogprob
from kvship.server.body import accept
from kvship.server.errors import bad_request
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
from kvship.server.prompts import chat_prompt_ids, chat_size, check_text_fits, generation_prompt, run_tokenizer
from kvship.server.protocol import ChatCompletionRequest
from kvship.server.responses import Envelope, TokenText, finish_reason, new_id, safe_logprob, usage_json
from kvship.server.sse import sse, sse_response
from kvship.server.tool_prompt import tool_format
from kvship.server.tools import ToolPlan, tool_plan

router = APIRouter()

TEMPLATE_OWN_KEYS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools",
                               "chat_template"})


def _logprobs_json(choice_logprobs: list[tuple[TokenLogprob, list[TokenLogprob]]] | None,
                   token_text: TokenText) -> dict[str, Any] | None:
    if choice_logprobs is None:
        return None
    content = []
    for sampled, top in choice_logprobs:
        tok = token_text(sampled.token_id)
        content.append(
            {
                "token": tok,
                "logprob": safe_logprob(sampled.logprob),
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := token_text(alt.token_id)), "logprob": safe_logprob(alt.logprob), "bytes": list(t.encode("utf-8"))}
                    for alt in top
                ],
            }
        )
    return {"content": content, "refusal": None}


def template_kwargs(body: ChatCompletionRequest, plan: ToolPlan | None) -> dict[str, object]:
    """What the chat template is given beside the messages: the request's chat_template_kwargs
    (a 400 for keys the request's own fields set), its tools, its reasoning_effort."""
    kwargs = dict(body.chat_template_kwargs or {})
    taken = TEMPLATE_OWN_KEYS & set(kwargs)
    if taken:  # what the request's own fields set (or, for chat_template, what the server owns)
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(taken))}.",
                          param="chat_template_kwargs")
    if plan is not None:  # the model sees the tools (tool_choice "none": it is not told of them)
        kwargs["tools"] = plan.template_tools()
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    return kwargs


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    arrival = time.monotonic()  # queue time and TTFT count from here, the server's own work included
    body, state, engine = await accept(raw_request, ChatCompletionRequest)
    add_generation_prompt, continue_final = generation_prompt(body)
    params = sampling_params(body, engine)
    plan = tool_plan(body, tool_format(engine.tokenizer, state.tool_call_parser).parser)
    params = with_tool_constraint(params, plan)
    params = with_reasoning_markers(params, state.reasoning_parser)
    await prepare_grammar(params, engine)
    check_text_fits(engine.tokenizer, chat_size(body.messages), engine.max_model_len, "messages")
    prompt_ids = await run_tokenizer(chat_prompt_ids, engine.tokenizer, body.messages, add_generation_prompt,
                                     template_kwargs(body, plan), continue_final, size=chat_size(body.messages))
    params = fit_to_context(params, [len(prompt_ids)], engine.max_model_len, "messages")

    request_id = new_id("chatcmpl")
    observer = observe_request(raw_request, request_id, params)
    state.admission.reserve(engine, 1)
    stream = GenerationStream(engine, [prompt_ids], params, request_id, state.active, observer, state.admission,
                              arrival_time=arrival, final_only=not body.stream)
    token_text = TokenText(engine.tokenizer)
    if body.stream:
        try:
            _, first = await first_output(raw_request, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        envelope = Envelope(request_id, "chat.completion.chunk", engine.model_name, with_usage=include_usage)
        shapers = [MessageShaper(state.reasoning_parser, plan) for _ in range(params.n)]
        return sse_response(stream, request_id, _stream_chunks(stream, first, envelope, shapers, token_text))

    try:
        finals = await final_outputs(raw_request, stream, 1)
    except ClientDisconnected:
        return Response(status_code=499)
    await stream.aclose()
    final = finals[0]
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        shaper = MessageShaper(state.reasoning_parser, plan)
        choices.append(
            {
                "index": c.index,
                "message": shaper.message(c.text),
                "logprobs": _logprobs_json(c.logprobs, token_text) if params.logprobs is not None else None,
                "finish_reason": shaper.finish_reason(finish_reason(c)),
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    prompt_tokens = len(final.prompt_token_ids) if final.prompt_token_ids else len(prompt_ids)
    envelope = Envelope(request_id, "chat.completion", engine.model_name)
    return JSONResponse(envelope.body(choices, usage=usage_json(prompt_tokens, completion_tokens)))


async def _stream_chunks(stream: GenerationStream, first: RequestOutput, envelope: Envelope,
                         shapers: list[MessageShaper], token_text: TokenText) -> AsyncIterator[str]:
    n = len(shapers)
    finished = [False] * n
    last = first
    for i in range(n):
        yield sse(envelope.body([{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                                  "logprobs": None, "finish_reason": None}]))
    out: RequestOutput | None = first
    while out is not None:
        last = out
        for c in sorted(out.outputs, key=lambda c: c.index):
            if finished[c.index]:
                continue
            lp = c.logprobs_delta
            shaper = shapers[c.index]
            delta = shaper.delta(c.text_delta) if c.text_delta else {}
            if delta or lp:
                yield sse(envelope.body([{
                    "index": c.index,
                    "delta": delta or {"content": ""},
                    "logprobs": _logprobs_json(lp, token_text) if lp is not None else None,
                    "finish_reason": None,
                }]))
            if c.finish_reason is not None:
                finished[c.index] = True
                rest = shaper.delta("", final=True)
                if rest:
                    yield sse(envelope.body([{"index": c.index, "delta": rest, "logprobs": None, "finish_reason": None}]))
                yield sse(envelope.body([{"index": c.index, "delta": {}, "logprobs": None,
                                          "finish_reason": shaper.finish_reason(finish_reason(c))}]))
        try:
            _, out = await stream.__anext__()
        except StopAsyncIteration:
            out = None
    if envelope.with_usage:
        yield sse(envelope.body([], usage=usage_json(len(last.prompt_token_ids),
                                                     sum(len(c.token_ids) for c in last.outputs))))
