"""What the server needs from the engine, as one typed protocol.

`kvship.core.async_engine.AsyncEngine` implements it (its step loop in a thread of this
process); an engine in another process would implement the same surface, and the server would
not change. Nothing here imports FastAPI: the protocol is the seam between the two.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from kvship.config import EngineConfig
from kvship.core.async_engine import EngineStats
from kvship.loader.pooling import Pooling
from kvship.loader.tokenizer import Tokenizer
from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams, StructuredOutput


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    config: EngineConfig  # limits the server enforces before submitting (max_num_seqs)
    tokenizer: Tokenizer
    sampling_defaults: dict[str, float]  # the model's own values for fields a request leaves out
    task: str  # "generate" (generate() serves) or "embed" (embed() serves)
    pooling: Pooling | None  # how embed() pools (task "embed")
    embedding_size: int  # the full length of an embedding

    async def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Pooled float32 embeddings, one per prompt. Raises QueueFullError / EngineDeadError /
        InvalidParamsError."""
        ...

    def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                 arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                 final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (with ``final_only``, only the finished one);
        closing the iterator early aborts it.
        ``arrival_time`` (time.monotonic()): when the server accepted it; latency metrics count
        from there (default: now).
        Raises QueueFullError / EngineDeadError / InvalidParamsError on its first read."""
        ...

    def add_lora(self, lora_request: LoRARequest) -> Future:
        """Read and check a LoRA adapter; the future fails with InvalidParamsError naming what
        the engine cannot serve."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Compile an output constraint off the event loop (InvalidParamsError if it cannot be served)."""
        ...

    def stats(self) -> EngineStats: ...

    def is_alive(self) -> bool: ...
