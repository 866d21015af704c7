"""vLLM's /tokenize and /detokenize: count a prompt's tokens (or a chat's, through the chat
template) before sending it, and turn token ids back into text."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvship.server.body import accept
from kvship.server.errors import SafeJSONResponse, bad_request
from kvship.server.prompts import (
    OFFLOAD_CHARS,
    chat_prompt_ids,
    chat_size,
    check_token_ids,
    generation_prompt,
    run_tokenizer,
)
from kvship.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


async def _json(data: dict, size: int) -> Response:
    """Serialising a million token ids takes most of a second: large answers are written in a
    worker thread, off the event loop."""
    if size <= OFFLOAD_CHARS:
        return SafeJSONResponse(data)
    content = await asyncio.to_thread(lambda: json.dumps(data, separators=(",", ":")).encode())
    return Response(content, media_type="application/json")


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> Response:
    body, _, engine = await accept(raw_request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of prompt and messages.", param="prompt")
    if body.messages is not None:
        add_generation_prompt, continue_final = generation_prompt(body)
        ids = await run_tokenizer(chat_prompt_ids, engine.tokenizer, body.messages, add_generation_prompt, None,
                                  continue_final, size=chat_size(body.messages))
    else:
        ids = await run_tokenizer(engine.tokenizer.encode, body.prompt, body.add_special_tokens, size=len(body.prompt))
    return await _json({"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}, len(ids))


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> Response:
    body, _, engine = await accept(raw_request, DetokenizeRequest)

    def decode(ids: list[int]) -> str:
        check_token_ids(ids, engine.tokenizer.vocab_size, "tokens")
        return engine.tokenizer.decode(ids, False)

    text = await run_tokenizer(decode, body.tokens, size=len(body.tokens))
    return await _json({"prompt": text}, len(text))
