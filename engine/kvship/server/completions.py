"""POST /v1/completions: one engine request per prompt (a string, strings, token ids or lists of
token ids), n choices each; choice index = prompt_index * n + choice. JSON or SSE."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvship.outputs import RequestOutput, TokenLogprob
from kvship.server.body import accept
from kvship.server.errors import SafeJSONResponse
from kvship.server.generation import ClientDisconnected, GenerationStream, final_outputs, first_output
from kvship.server.metrics import observe_request
from kvship.server.params import fit_to_context, prepare_grammar, sampling_params
from kvship.server.prompts import (
    check_prompt_count,
    check_text_fits,
    completion_prompts,
    completion_size,
    completion_texts,
    run_tokenizer,
)
from kvship.server.protocol import CompletionRequest
from kvship.server.responses import Envelope, TokenText, finish_reason, new_id, safe_logprob, usage_json
from kvship.server.sse import sse, sse_response

router = APIRouter()

Logprobs = list[tuple[TokenLogprob, list[TokenLogprob]]]


class _LogprobBuilder:
    """Builds the legacy completions `logprobs` object; `offset` tracks text_offset."""

    def __init__(self, token_text: TokenText, offset: int):
        self.token_text = token_text
        self.offset = offset

    def build(self, entries: Logprobs | None) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for sampled, top in entries or []:
            s = self.token_text(sampled.token_id)
            tokens.append(s)
            token_logprobs.append(safe_logprob(sampled.logprob))
            alts = {self.token_text(alt.token_id): safe_logprob(alt.logprob) for alt in top}
            alts.setdefault(s, safe_logprob(sampled.logprob))
            top_logprobs.append(alts)
            text_offset.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}

    def build_with_prompt(self, prompt_ids: list[int], prompt_entries: Logprobs, entries: Logprobs | None) -> dict[str, Any]:
        """Echo with logprobs: the prompt's tokens first (the first one has no logprob: nothing
        precedes it), then the completion's."""
        first = self.token_text(prompt_ids[0])
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(first)
        rest = [self.build(prompt_entries), self.build(entries)]
        return {k: head[k] + rest[0][k] + rest[1][k] for k in head}


@router.post("/v1/completions")
async def create_completion(raw_request: Request) -> Response:
    arrival = time.monotonic()  # queue time and TTFT count from here, the server's own work included
    body, state, engine = await accept(raw_request, CompletionRequest)
    params = sampling_params(body, engine)
    await prepare_grammar(params, engine)
    check_prompt_count(body.prompt, state.max_prompts_per_request)
    for text in completion_texts(body.prompt):
        check_text_fits(engine.tokenizer, len(text), engine.max_model_len, "prompt")
    prompt_ids, prompt_texts = await run_tokenizer(completion_prompts, engine.tokenizer, body.prompt,
                                                   size=completion_size(body.prompt))
    params = fit_to_context(params, [len(ids) for ids in prompt_ids], engine.max_model_len, "prompt")
    echo_texts = [
        (t if t is not None else engine.tokenizer.decode(ids)) if body.echo else "" for ids, t in zip(prompt_ids, prompt_texts)
    ]

    request_id = new_id("cmpl")
    n = params.n
    observer = observe_request(raw_request, request_id, params, len(prompt_ids))
    state.admission.reserve(engine, len(prompt_ids))
    stream = GenerationStream(engine, prompt_ids, params, request_id, state.active, observer, state.admission,
                              arrival_time=arrival, final_only=not body.stream)
    token_text = TokenText(engine.tokenizer)
    want_logprobs = body.logprobs is not None
    if body.stream:
        try:
            first = await first_output(raw_request, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        envelope = Envelope(request_id, "text_completion", engine.model_name, with_usage=include_usage)
        return sse_response(stream, request_id,
                            _stream_chunks(stream, first, envelope, n, prompt_ids, echo_texts, want_logprobs,
                                           token_text))

    try:
        finals = await final_outputs(raw_request, stream, len(prompt_ids))
    except ClientDisconnected:
        return Response(status_code=499)
    await stream.aclose()
    choices = []
    prompt_tokens = completion_tokens = 0
    for p_index, final in enumerate(finals):
        prompt_tokens += len(final.prompt_token_ids) if final.prompt_token_ids else len(prompt_ids[p_index])
        for c in sorted(final.outputs, key=lambda c: c.index):
            completion_tokens += len(c.token_ids)
            echo = echo_texts[p_index]
            if not want_logprobs:
                logprobs = None
            elif final.prompt_logprobs is not None:
                logprobs = _LogprobBuilder(token_text, 0).build_with_prompt(prompt_ids[p_index], final.prompt_logprobs,
                                                                           c.logprobs)
            else:
                logprobs = _LogprobBuilder(token_text, len(echo)).build(c.logprobs)
            choices.append(
                {
                    "index": p_index * n + c.index,
                    "text": echo + c.text,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(c),
                }
            )
    envelope = Envelope(request_id, "text_completion", engine.model_name)
    return SafeJSONResponse(envelope.body(choices, usage=usage_json(prompt_tokens, completion_tokens)))


async def _stream_chunks(
    stream: GenerationStream,
    first: tuple[int, RequestOutput],
    envelope: Envelope,
    n: int,
    prompt_ids: list[list[int]],
    echo_texts: list[str],
    want_logprobs: bool,
    token_text: TokenText,
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> str:
        return sse(envelope.body([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]))

    n_prompts = len(prompt_ids)
    started = [False] * (n_prompts * n)
    finished = [False] * (n_prompts * n)
    # With echo + logprobs the prompt's own tokens carry the text offsets from 0.
    echo_lp = want_logprobs and first[1].prompt_logprobs is not None
    builders = [_LogprobBuilder(token_text, 0 if echo_lp else len(echo_texts[i // n])) for i in range(n_prompts * n)]
    last: dict[int, RequestOutput] = {}
    item: tuple[int, RequestOutput] | None = first
    while item is not None:
        p_index, out = item
        last[p_index] = out
        for c in sorted(out.outputs, key=lambda c: c.index):
            idx = p_index * n + c.index
            if finished[idx]:
                continue
            text = c.text_delta
            if echo_lp and not started[idx]:  # the prompt's logprobs lead the first chunk
                lp = builders[idx].build_with_prompt(prompt_ids[p_index], out.prompt_logprobs or [],
                                                     c.logprobs_delta)
            else:
                lp = builders[idx].build(c.logprobs_delta) if want_logprobs else None
            if not started[idx]:
                started[idx] = True
                text = echo_texts[p_index] + text
            fr = finish_reason(c)
            if text or (lp and lp["tokens"]) or fr is not None:
                yield chunk(idx, text, lp, fr)
            if fr is not None:
                finished[idx] = True
        try:
            item = await stream.__anext__()
        except StopAsyncIteration:
            item = None
    if envelope.with_usage:
        prompt_tokens = sum(len(prompt_ids[i]) for i in range(n_prompts))
        completion_tokens = sum(len(c.token_ids) for out in last.values() for c in out.outputs)
        yield sse(envelope.body([], usage=usage_json(prompt_tokens, completion_tokens)))
