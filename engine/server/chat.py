"""POST /v1/chat/completions: chat template, then one engine request with n choices; answered as
one JSON body or as Server-Sent Events in OpenAI's chunk format."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvship.outputs import RequestOutput
from kvship.sampling_params import MAX_LOGPROBS
from kvship.server.errors import bad_request
from kvship.server.metrics import observe_request
from kvship.server.protocol import ChatCompletionRequest, ChatMessage
from kvship.server.serving import (
    ClientDisconnected,
    GenerationStream,
    TokenText,
    accept,
    build_sampling_params,
    finish_reason,
    fit_to_context,
    new_id,
    run_tokenizer,
    safe_logprob,
    sse,
    sse_response,
    start,
    usage_json,
)

router = APIRouter()


def chat_prompt_ids(engine: Any, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template rendered over `messages`."""
    messages = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        rendered = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:  # ChatTemplateError included
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from None
    if isinstance(rendered, str):
        # The template already carries the special tokens (BOS etc.).
        return list(engine.tokenizer.encode(rendered, add_special_tokens=False))
    return list(rendered)


def _logprobs_json(choice_logprobs: list | None, token_text: TokenText) -> dict[str, Any] | None:
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


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    body, state, engine = await accept(raw_request, ChatCompletionRequest)

    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("logprobs must be set to true when top_logprobs is used.", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}.", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = build_sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, max_num_seqs=engine.config.max_num_seqs,
                                   defaults=engine.sampling_defaults)

    prompt_ids = await run_tokenizer(chat_prompt_ids, engine, body.messages, body.add_generation_prompt is not False,
                                     size=sum(len(m.text()) for m in body.messages))
    params = fit_to_context(params, len(prompt_ids), engine.max_model_len, "messages")

    request_id = new_id("chatcmpl")
    created = int(time.time())
    model = state.model_name
    observer = observe_request(raw_request, request_id, params)
    stream = GenerationStream(engine, [prompt_ids], params, request_id, state.active, observer)
    try:
        first = finals = await start(raw_request, stream, body.stream, 1)
    except ClientDisconnected:
        return Response(status_code=499)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    token_text = TokenText(engine.tokenizer)
    if body.stream:
        return sse_response(stream, request_id,
                            _stream_chunks(stream, first[1], request_id, created, model, params.n, include_usage,
                                           token_text))

    await stream.aclose()
    final = finals[0]
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": _logprobs_json(c.logprobs, token_text) if logprobs is not None else None,
                "finish_reason": finish_reason(c),
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    prompt_tokens = len(final.prompt_token_ids) if final.prompt_token_ids else len(prompt_ids)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage_json(prompt_tokens, completion_tokens),
            "system_fingerprint": None,
        }
    )


async def _stream_chunks(
    stream: GenerationStream,
    first: RequestOutput,
    request_id: str,
    created: int,
    model: str,
    n: int,
    include_usage: bool,
    token_text: TokenText,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]]) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if include_usage:
            data["usage"] = None
        return sse(data)

    finished = [False] * n
    last = first
    for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None}, "logprobs": None, "finish_reason": None}])
    out: RequestOutput | None = first
    while out is not None:
        last = out
        for c in sorted(out.outputs, key=lambda c: c.index):
            if finished[c.index]:
                continue
            lp = c.logprobs_delta
            if c.text_delta or lp:
                yield chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"content": c.text_delta},
                            "logprobs": _logprobs_json(lp, token_text) if lp is not None else None,
                            "finish_reason": None,
                        }
                    ]
                )
            if c.finish_reason is not None:
                finished[c.index] = True
                yield chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(c)}])
        try:
            _, out = await stream.__anext__()
        except StopAsyncIteration:
            out = None
    if include_usage:
        yield sse(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": None,
                "choices": [],
                "usage": usage_json(len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs)),
            }
        )
