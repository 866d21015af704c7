"""Response bodies in OpenAI's shapes: the envelope every body and chunk shares
(`id/object/created/model`), usage, finish reasons and logprob values."""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvship.loader.tokenizer import Tokenizer
from kvship.outputs import CompletionOutput

# JSON has no -inf; a token the sampler could never pick gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Envelope:
    """What one response's body, or each of its stream chunks, starts with. `with_usage`: a
    stream that sends usage at its end (stream_options.include_usage) carries `usage: null` in
    every chunk before."""

    id: str
    object: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    with_usage: bool = False

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if usage is not None or self.with_usage:
            data["usage"] = usage
        return data


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(c: CompletionOutput) -> str | None:
    """A choice's OpenAI finish_reason: an aborted one (client gone, server draining) reads "stop"."""
    return "stop" if c.finish_reason == "abort" else c.finish_reason


def safe_logprob(x: float | None) -> float:
    if x is None or math.isnan(x):
        return MIN_LOGPROB
    return max(float(x), MIN_LOGPROB)


class TokenText:
    """token id -> its text as logprobs show it (cached per request)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.token_to_str(token_id)
            self._cache[token_id] = s
        return s
