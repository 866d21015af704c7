"""What the engine hands back for each request, step by step (streamed) and at the end."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass
class CompletionOutput:
    """One of the request's n choices. Text and token fields are cumulative; `*_delta` fields
    hold only what this update adds (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # For each generated token: (sampled token logprob, top alternatives), when asked for.
    logprobs: list[tuple[TokenLogprob, list[TokenLogprob]]] | None = None
    logprobs_delta: list[tuple[TokenLogprob, list[TokenLogprob]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (a grammar with no allowed token)
    stop_reason: str | int | None = None  # matched stop string or stop token id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[tuple[TokenLogprob, list[TokenLogprob]]] | None = None
    # Timestamps (time.monotonic) for metrics/tracing.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
