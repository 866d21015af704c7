"""What every handler shares, kept on `app.state.kvship` (no module globals): the engine (or
None while it loads), its configuration, the API key, the drain flag and the generations in
flight."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from kvship.config import EngineConfig
from kvship.server.engine_client import EngineClient
from kvship.server.errors import APIError, ServerShuttingDown, queue_full
from kvship.server.generation import GenerationStream
from kvship.server.lora import AdapterEngine, LoRARegistry

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
DEFAULT_MAX_BODY_BYTES = 8 << 20  # 8 MiB: far above any prompt that fits a 128k-token context
LARGE_BODY_PARSES = 2  # large bodies (server/body.py) parsed at a time; the rest wait their turn


class Admission:
    """Room in the engine's waiting queue, held for a request's prompts from the moment the
    request is admitted until each prompt is submitted, so that a multi-prompt request is
    admitted whole or refused whole: checked against the queue prompt by prompt, it used to
    fill the queue (and refuse everyone else) before being refused itself."""

    def __init__(self) -> None:
        self.reserved = 0  # prompts admitted, not yet submitted (not yet counted by the engine)

    def reserve(self, engine: EngineClient, n: int) -> None:
        limit = engine.config.max_waiting_requests
        if engine.stats().num_requests_waiting + self.reserved + n > limit:
            raise queue_full()
        self.reserved += n

    def release(self, n: int = 1) -> None:
        self.reserved -= n


DEFAULT_RESPONSES_STORE_BYTES = 64 << 20


class ResponseStore:
    """Conversations of stored /v1/responses responses (their chat messages, output included),
    for previous_response_id, in memory: the newest are kept, at most `capacity` of them and
    `max_bytes` of their text (a count alone let 1000 conversations of megabytes each stay)."""

    def __init__(self, capacity: int = 1000, max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = _text_bytes(messages)
        if size > self.max_bytes:  # would evict everything and still not fit
            return
        self._items[response_id] = (messages, size)
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted

    def get(self, response_id: str) -> list[dict] | None:
        item = self._items.get(response_id)
        return None if item is None else [dict(m) for m in item[0]]

    def __len__(self) -> int:
        return len(self._items)


def _text_bytes(value: object) -> int:
    """The characters of text in a stored conversation, plus a little per container: what it
    costs to keep, roughly (Python's own overhead is proportional)."""
    if isinstance(value, str):
        return len(value) + 64
    if isinstance(value, dict):
        return 64 + sum(_text_bytes(k) + _text_bytes(v) for k, v in value.items())
    if isinstance(value, list):
        return 64 + sum(_text_bytes(v) for v in value)
    return 16


class ServerState:
    def __init__(self, engine: EngineClient | None, config: EngineConfig | None, api_key: str | None = None,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None,
                 responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES,
                 allow_runtime_lora_updating: bool = False):
        self.engine = engine
        self.config = config
        self.api_key = api_key
        self.draining = False  # set on SIGTERM: /health turns 503, new work is refused
        self.created = int(time.time())
        self.active: set[GenerationStream] = set()  # in-flight generations
        self.admission = Admission()
        self.max_prompts_per_request = max_prompts_per_request
        self.max_body_bytes = max_body_bytes
        self.tool_call_parser = tool_call_parser  # --tool-call-parser; None: chosen from the chat template
        self.reasoning_parser = reasoning_parser
        self.responses = ResponseStore(max_bytes=responses_store_bytes)
        self.loras = LoRARegistry(bool(config and config.enable_lora), allow_runtime_lora_updating)
        # Large bodies parsed at once: each costs several times its size while it is parsed.
        self.large_body_slots = asyncio.Semaphore(LARGE_BODY_PARSES)

    def end_all(self) -> int:
        """End every in-flight generation (the drain period is over); how many there were. A
        stream already under way ends as a finished one does (a last chunk with its
        finish_reason, then [DONE]) so that clients keep what they got; a request not yet
        answered gets a 503 it can retry elsewhere."""
        streams = list(self.active)
        for s in streams:
            if s.streaming:
                s.cut()
            else:
                s.interrupt(ServerShuttingDown())
        return len(streams)

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            return self.engine.model_name
        return (self.config.served_model_name or self.config.model or "kvship") if self.config else "kvship"

    @property
    def max_model_len(self) -> int | None:
        if self.engine is not None:
            return self.engine.max_model_len
        return self.config.max_model_len if self.config is not None else None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.is_alive()

    def engine_or_503(self) -> EngineClient:
        if self.engine is None:
            raise APIError(503, "The model is still loading.", code="not_ready", headers={"Retry-After": "5"})
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if not self.engine.is_alive():
            raise APIError(503, "The inference engine has stopped.", code="engine_dead")
        return self.engine

    def engine_for(self, model: str | None) -> EngineClient:
        """The engine (engine_or_503) as a request naming ``model`` uses it: with the LoRA
        adapter of that name, if it is one."""
        engine = self.engine_or_503()
        lora = self.loras.get(model) if model != self.model_name else None
        return engine if lora is None else AdapterEngine(engine, lora)

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.model_name or self.loras.get(model) is not None:
            return
        raise APIError(
            404,
            f"The model `{model}` does not exist.",
            param="model",
            code="model_not_found",
        )
