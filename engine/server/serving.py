"""What the chat and completions handlers share: model check, sampling parameters, prompt length
checks, running a generation while watching the client, and merging several prompts' streams.

The handlers talk to the engine only through `engine.generate(...)` (an async iterator of
`RequestOutput`s; closing it aborts the request) and `engine.abort(...)`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from kvship.core.async_engine import EngineDeadError, QueueFullError
from kvship.outputs import RequestOutput, TokenLogprob
from kvship.sampling_params import InvalidParamsError, SamplingParams
from kvship.server.errors import APIError, bad_request
from kvship.server.protocol import _SamplingFields

logger = logging.getLogger("kvship.server")

T = TypeVar("T")

MAX_N = 128  # upper bound on `n` (also bounded by the engine's max_num_seqs)
RETRY_AFTER_S = 1
# JSON has no -inf; a token the sampler could never pick gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ServerState:
    """Everything a handler needs, kept on `app.state.kvship` (no module globals)."""

    def __init__(self, engine: Any, config: Any, api_key: str | None = None):
        self.engine = engine
        self.config = config
        self.api_key = api_key
        self.draining = False  # set on SIGTERM: /health turns 503, new work is refused
        self.drain_scheduled = False
        self.created = int(time.time())
        self.active: set[GenerationStream] = set()  # in-flight generations

    def interrupt_all(self) -> int:
        """Abort every in-flight generation (end of the drain period); how many there were."""
        streams = list(self.active)
        for s in streams:
            s.interrupt(ServerShuttingDown())
        return len(streams)

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            return self.engine.model_name
        return (self.config.served_model_name or self.config.model or "kvship") if self.config else "kvship"

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.is_alive()

    def engine_or_503(self) -> Any:
        if self.engine is None:
            raise APIError(503, "The model is still loading.", code="not_ready", headers={"Retry-After": "5"})
        if self.draining:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if not self.engine.is_alive():
            raise APIError(503, "The inference engine has stopped.", code="engine_dead")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.model_name:
            return
        raise APIError(
            404,
            f"The model `{model}` does not exist.",
            param="model",
            code="model_not_found",
        )


def engine_error(exc: BaseException) -> APIError | None:
    """The API error for an exception raised by the engine, or None if it is not one of ours."""
    if isinstance(exc, InvalidParamsError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            "The server is overloaded: too many requests are waiting. Retry shortly.",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, "The server is shutting down; the request was aborted.", code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, "The inference engine has stopped.", code="engine_dead")
    return None


def _opt(value: Any, default: Any) -> Any:
    return default if value is None else value


def build_sampling_params(
    body: _SamplingFields, *, max_tokens: int | None, logprobs: int | None, max_num_seqs: int,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """`defaults`: the model's recommended settings for fields the request leaves out."""
    defaults = defaults or {}
    n = _opt(body.n, 1)
    if n > min(MAX_N, max_num_seqs):
        raise bad_request(f"n must be at most {min(MAX_N, max_num_seqs)}, got {n}.", param="n")
    stop = body.stop
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            n=n,
            temperature=_opt(body.temperature, defaults.get("temperature", 1.0)),
            top_p=_opt(body.top_p, defaults.get("top_p", 1.0)),
            top_k=_opt(body.top_k, defaults.get("top_k", -1)),
            min_p=_opt(body.min_p, defaults.get("min_p", 0.0)),
            presence_penalty=_opt(body.presence_penalty, 0.0),
            frequency_penalty=_opt(body.frequency_penalty, 0.0),
            repetition_penalty=_opt(body.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=_opt(body.min_tokens, 0),
            stop=list(stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            skip_special_tokens=_opt(body.skip_special_tokens, True),
        )
    except InvalidParamsError as exc:
        raise bad_request(str(exc), param=exc.param) from None


def fit_to_context(params: SamplingParams, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
    """Check the prompt (and prompt + max_tokens) against the context window; a copy of
    `params` with max_tokens filled in when it was left open."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, leaving no room for the completion. Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if params.max_tokens is None:
        return _with_max_tokens(params, max_model_len - prompt_len)
    if prompt_len + params.max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=max_tokens)


# Tokenizing a long prompt takes milliseconds; above this many characters it runs in a worker
# thread so that the event loop keeps streaming other requests' tokens meanwhile.
OFFLOAD_CHARS = 8192


async def run_tokenizer(fn: Any, *args: Any, size: int) -> Any:
    if size > OFFLOAD_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise bad_request(f"Token id {t} is out of range [0, {vocab_size}).", param=param)


# ------------------------------------------------------------ client watching


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and raising ClientDisconnected) if the client goes away."""
    work = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientDisconnected()
    finally:
        for task in (work, listener):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, listener, return_exceptions=True)


# ------------------------------------------------------------ generation streams

_END = object()


class ServerShuttingDown(Exception):
    """Handed to in-flight requests that outlive the drain period after SIGTERM."""


class GenerationStream:
    """One or several engine requests (one per prompt) as a single async iterator of
    `(prompt_index, RequestOutput)`. Each engine request is pumped by its own task into one
    queue, so the consumer can also be interrupted (`interrupt`, used at shutdown). `aclose()`
    stops everything and aborts what still runs in the engine."""

    def __init__(self, engine: Any, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 registry: set | None = None, observer: Any | None = None):
        self.engine = engine
        self._observer = observer  # metrics / span events (RequestObserver), fed every output
        self.request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self._params = params
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(prompts)
        self._closed = False
        self._registry = registry
        if registry is not None:
            registry.add(self)
        self._tasks = [
            asyncio.ensure_future(self._pump(i, p, rid)) for i, (p, rid) in enumerate(zip(prompts, self.request_ids))
        ]

    async def _pump(self, index: int, prompt: list[int], request_id: str) -> None:
        gen = self.engine.generate(prompt, self._params, request_id)
        error: BaseException | None = None
        try:
            async for out in gen:
                if self._observer is not None:
                    self._observer.on_output(index, out)
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer
            error = exc
            self._queue.put_nowait((index, exc))
        finally:
            if self._observer is not None:
                self._observer.on_end(index, error)
            await _aclose(gen)
            self._queue.put_nowait((index, _END))

    def interrupt(self, exc: BaseException) -> None:
        """Make the consumer's next (or pending) read raise `exc`."""
        self._queue.put_nowait((-1, exc))

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._remaining:
            index, item = await self._queue.get()
            if item is _END:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._registry is not None:
            self._registry.discard(self)
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        # Abort before awaiting anything: when a stream is torn down by a client disconnect,
        # the surrounding cancel scope may interrupt the first await below.
        for rid in self.request_ids if pending else ():
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - aborting must never fail a response
                logger.debug("abort(%s) failed", rid, exc_info=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _aclose(gen: Any) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001
            logger.debug("closing a generation failed", exc_info=True)


async def collect(stream: GenerationStream, n_prompts: int) -> list[RequestOutput]:
    """Run a stream to the end; the final RequestOutput of each prompt."""
    finals: list[RequestOutput | None] = [None] * n_prompts
    async for index, out in stream:
        finals[index] = out
    return [f for f in finals if f is not None]


async def start(raw_request: Request, stream: GenerationStream, streaming: bool, n_prompts: int) -> Any:
    """Streaming: the first (index, output), awaited before answering so that a refused request
    (queue full, invalid) gets a real status code instead of an error inside a 200 stream.
    Otherwise: every prompt's final output. Raises ClientDisconnected (stream closed) when the
    client went away, or the APIError the engine's failure maps to."""
    try:
        if streaming:
            return await until_disconnect(raw_request, stream.__anext__())
        return await until_disconnect(raw_request, collect(stream, n_prompts))
    except StopAsyncIteration:
        await stream.aclose()
        raise APIError(500, "The engine produced no output.", type="server_error") from None
    except BaseException as exc:
        await stream.aclose()
        err = None if isinstance(exc, ClientDisconnected) else engine_error(exc)
        if err is not None:
            raise err from None
        raise


# ------------------------------------------------------------ small helpers


def safe_logprob(x: float) -> float:
    if x is None or math.isnan(x):
        return MIN_LOGPROB
    return max(float(x), MIN_LOGPROB)


class TokenText:
    """token id -> its text as logprobs show it (cached per request)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._tok.token_to_str(token_id)
            self._cache[token_id] = s
        return s


def top_list(entry: tuple[TokenLogprob, list[TokenLogprob]]) -> list[TokenLogprob]:
    return list(entry[1])


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(c: Any) -> str | None:
    """A choice's OpenAI finish_reason: an aborted one (client gone, server draining) reads "stop"."""
    return "stop" if c.finish_reason == "abort" else c.finish_reason


def sse_response(stream: GenerationStream, request_id: str, chunks: AsyncIterator[str]) -> Any:
    """`chunks` as Server-Sent Events, then [DONE]. Once streaming, the status line is gone: an
    error is reported inside the stream; the engine request is closed however it ends."""
    from fastapi.responses import StreamingResponse

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
            yield SSE_DONE
        except Exception as exc:  # noqa: BLE001
            err = engine_error(exc) or APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
            if err.status >= 500:
                logger.warning("stream %s failed: %r", request_id, exc)
            yield sse(err.body())
            yield SSE_DONE
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def accept(raw_request: Request, model: type[T]) -> tuple[T, ServerState, Any]:
    """The parsed body, the server state and the engine, for an endpoint that uses the model
    (404 for another model's name, 503 while the engine is not serving)."""
    body = await parse_body(raw_request, model)
    state: ServerState = raw_request.app.state.kvship
    state.check_model(body.model)
    return body, state, state.engine_or_503()


async def parse_body(request: Request, model: type[T]) -> T:
    """The JSON body as `model`, whatever the Content-Type says (curl -d sends form encoding);
    malformed JSON and wrong types become OpenAI-shaped 400s."""
    from pydantic import ValidationError

    from kvship.server.errors import validation_error

    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise validation_error([{"type": "json_invalid", "loc": ("body",), "msg": "invalid JSON"}]) from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)  # type: ignore[attr-defined]
    except ValidationError as exc:
        errors = [dict(e, loc=("body", *e.get("loc", ()))) for e in exc.errors()]
        raise validation_error(errors) from None
