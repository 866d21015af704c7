"""vLLM's /tokenize and /detokenize: count a prompt's tokens (or a chat's, through the chat
template) before sending it, and turn token ids back into text."""
from __future__ import annotations

from fastapi import APIRouter, Request

from kvship.server.chat import chat_prompt_ids
from kvship.server.errors import bad_request
from kvship.server.protocol import DetokenizeRequest, TokenizeRequest
from kvship.server.serving import accept, check_token_ids, run_tokenizer

router = APIRouter()


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> dict:
    body, _, engine = await accept(raw_request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of prompt and messages.", param="prompt")
    if body.messages is not None:
        size = sum(len(m.text()) for m in body.messages)
        ids = await run_tokenizer(chat_prompt_ids, engine, body.messages, body.add_generation_prompt, size=size)
    else:
        ids = await run_tokenizer(engine.tokenizer.encode, body.prompt, body.add_special_tokens, size=len(body.prompt))
    return {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_model_len}


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> dict:
    body, _, engine = await accept(raw_request, DetokenizeRequest)
    check_token_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
    text = await run_tokenizer(engine.tokenizer.decode, body.tokens, False, size=len(body.tokens))
    return {"prompt": text}
