"""POST /v1/embeddings: one pooled vector per input (a string, strings, token ids or lists of
token ids), as floats or as base64 of little-endian float32 (what the openai SDK asks for by
default and decodes with numpy)."""
from __future__ import annotations

import base64
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvship.server.body import accept
from kvship.server.errors import SafeJSONResponse, bad_request, engine_error
from kvship.server.prompts import (
    check_prompt_count,
    check_text_fits,
    completion_prompts,
    completion_size,
    completion_texts,
    run_tokenizer,
)
from kvship.server.protocol import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(raw_request: Request) -> JSONResponse:
    body, state, engine = await accept(raw_request, EmbeddingRequest, task="embed")
    full = engine.embedding_size
    dims = body.dimensions
    if dims is not None and not engine.pooling.allows_dimensions(dims, full):
        allowed = engine.pooling.matryoshka_dimensions
        raise bad_request(
            f"This model's embeddings have {full} dimensions"
            + ("" if allowed is None else f"; it was trained for {', '.join(map(str, allowed)) or f'1 to {full}'}")
            + f", so `dimensions` {dims} cannot be served.", param="dimensions")
    check_prompt_count(body.input, state.max_prompts_per_request, "input")
    for text in completion_texts(body.input):
        check_text_fits(engine.tokenizer, len(text), engine.max_model_len + 1, "input")
    prompts, _ = await run_tokenizer(completion_prompts, engine.tokenizer, body.input, "input",
                                     size=completion_size(body.input))
    try:
        vectors = await engine.embed(prompts)
    except Exception as exc:
        err = engine_error(exc)
        if err is None:
            raise
        raise err from None
    data = [{"object": "embedding", "index": i, "embedding": _encode(_shorten(v, dims, engine.pooling.normalize),
                                                                        body.encoding_format)}
            for i, v in enumerate(vectors)]
    n = sum(map(len, prompts))
    return SafeJSONResponse({"object": "list", "data": data, "model": engine.model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})


def _shorten(v: torch.Tensor, dims: int | None, normalize: bool) -> torch.Tensor:
    """A Matryoshka prefix, scaled back to unit length when the model's vectors are."""
    if dims is None or dims >= v.shape[0]:
        return v
    v = v[:dims]
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _encode(v: torch.Tensor, encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
