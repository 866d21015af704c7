"""Running engine requests for one API request: one or several prompts merged into a single
stream, watched for the client going away, and always aborted in the engine when they end
early."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from fastapi import Request

from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams
from kvship.server.engine_client import EngineClient
from kvship.server.errors import APIError, engine_error

logger = logging.getLogger("kvship.server")

T = TypeVar("T")


class OutputObserver(Protocol):
    """Metrics / span events, fed every output of every prompt (RequestObserver)."""

    def on_output(self, index: int, out: RequestOutput) -> None: ...

    def on_end(self, index: int, error: BaseException | None) -> None: ...


class Reservations(Protocol):
    def release(self, n: int = 1) -> None: ...


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


class GenerationStream:
    """One or several engine requests (one per prompt) as a single async iterator of
    `(prompt_index, RequestOutput)`. Each engine request is pumped by its own task into one
    queue, so the consumer can also be interrupted (`interrupt`, used at shutdown). `aclose()`
    stops everything and aborts what still runs in the engine."""

    def __init__(self, engine: EngineClient, prompts: list[list[int]], params: SamplingParams, request_id: str,
                 registry: set[GenerationStream] | None = None, observer: OutputObserver | None = None,
                 admission: Reservations | None = None, arrival_time: float | None = None,
                 final_only: bool = False):
        """`admission`: where room for the prompts was reserved (Admission.reserve); each prompt's
        share is released as it is submitted, or when the stream closes before that.
        `arrival_time`: when the server accepted the request (time.monotonic()). `final_only`:
        each prompt's final output alone (an answer sent whole: no engine output a step)."""
        self._arrival_time = arrival_time
        self._final_only = final_only
        self.engine = engine
        self._admission = admission
        self._unsubmitted = len(prompts) if admission is not None else 0
        self._observer = observer
        self.request_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self._params = params
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._remaining = len(prompts)
        self._closed = False
        self.streaming = False  # answered as Server-Sent Events (sse_response): cut() ends it well
        self._registry = registry
        if registry is not None:
            registry.add(self)
        self._tasks = [
            asyncio.ensure_future(self._pump(i, p, rid)) for i, (p, rid) in enumerate(zip(prompts, self.request_ids))
        ]

    def _submitted(self, n: int = 1) -> None:
        n = min(n, self._unsubmitted)
        if n > 0:
            self._unsubmitted -= n
            assert self._admission is not None
            self._admission.release(n)

    async def _pump(self, index: int, prompt: list[int], request_id: str) -> None:
        gen = self.engine.generate(prompt, self._params, request_id, self._arrival_time, final_only=self._final_only)
        error: BaseException | None = None
        try:
            # The reservation is handed over here: generate() counts the request as waiting
            # before its first suspension, in this same step of the event loop.
            self._submitted()
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

    def cut(self) -> None:
        """End it now as a finished request ends: each prompt still running is aborted in the
        engine, whose final output (finish_reason "abort") closes its part of the stream."""
        for rid in self.request_ids:
            self.engine.abort(rid)

    def interrupt(self, exc: BaseException) -> None:
        """Make the consumer's next (or pending) read raise `exc`."""
        self._queue.put_nowait((-1, exc))

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._remaining:
            index, item = await self._queue.get()
            if item is _END:
                self._remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, RequestOutput)
            return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._submitted(self._unsubmitted)  # pumps cancelled before they ran
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


async def _aclose(gen: AsyncIterator[RequestOutput]) -> None:
    close = getattr(gen, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:
            logger.debug("closing a generation failed", exc_info=True)


async def collect(stream: GenerationStream, n_prompts: int) -> list[RequestOutput]:
    """Run a stream to the end; the final RequestOutput of each prompt."""
    finals: list[RequestOutput | None] = [None] * n_prompts
    async for index, out in stream:
        finals[index] = out
    return [f for f in finals if f is not None]


async def first_output(raw_request: Request, stream: GenerationStream) -> tuple[int, RequestOutput]:
    """The first (index, output) of a stream, awaited before answering so that a refused request
    (queue full, invalid) gets a real status code instead of an error inside a 200 stream."""
    return await _start(raw_request, stream, stream.__anext__())


async def final_outputs(raw_request: Request, stream: GenerationStream, n_prompts: int) -> list[RequestOutput]:
    """Every prompt's final output."""
    return await _start(raw_request, stream, collect(stream, n_prompts))


async def _start(raw_request: Request, stream: GenerationStream, work: Awaitable[T]) -> T:
    """Raises ClientDisconnected (stream closed) when the client went away, or the APIError the
    engine's failure maps to."""
    try:
        return await until_disconnect(raw_request, work)
    except StopAsyncIteration:
        await stream.aclose()
        raise APIError(500, "The engine produced no output.", type="server_error") from None
    except BaseException as exc:
        await stream.aclose()
        err = None if isinstance(exc, ClientDisconnected) else engine_error(exc)
        if err is not None:
            raise err from None
        raise
