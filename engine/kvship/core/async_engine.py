"""The engine for serving: its step loop runs in its own thread, off the asyncio event loop.

The server talks to it only through generate() (an async stream of outputs), abort() and
stats() (server/engine_client.py's protocol); core/engine_process.py serves the same protocol
from a process of its own.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from kvship.config import EngineConfig
from kvship.core.engine import LLMEngine
from kvship.core.speculative import SpecStats
from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.sampling_params import InvalidParamsError, SamplingParams, StructuredOutput

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # LoRA adapters (names) of running and waiting requests, and requests submitted per adapter
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    lora_requests_total: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecStats | None = None  # speculative decoding's counters, when it is on


@dataclass
class Rejected:
    """add_request refused the request (a client mistake); re-raised in the caller."""

    error: Exception


def engine_stats(e: LLMEngine, pending: int) -> EngineStats:
    """The engine's counters now; ``pending``: requests submitted that it has not seen yet
    (counted as waiting)."""
    kv, sched = e.kv, e.scheduler
    return EngineStats(
        num_requests_running=len({s.request_id for s in list(sched.running)}),
        num_requests_waiting=len({s.request_id for s in list(sched.waiting)}) + pending,
        num_kv_blocks_total=kv.num_blocks,
        num_kv_blocks_used=kv.num_used_blocks,
        num_kv_blocks_free=kv.num_free_blocks,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        num_preemptions=sched.num_preemptions,
        prompt_tokens_total=e.prompt_tokens_total,
        generation_tokens_total=e.generation_tokens_total,
        running_lora_adapters=sorted({s.lora.lora_name for s in list(sched.running) if s.lora is not None}),
        waiting_lora_adapters=sorted({s.lora.lora_name for s in list(sched.waiting) if s.lora is not None}),
        lora_requests_total=dict(e.lora_requests_total),
        spec_decode=copy.deepcopy(e.speculator.stats) if e.speculator is not None else None,
    )


class Stream:
    """Outputs of one request, handed from the engine's thread (or pipe reader) to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | Rejected | BaseException] = asyncio.Queue()
        self.ended = False  # the engine is done with the request: nothing left to abort

    def put(self, item: RequestOutput | Rejected | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs up to the finished one; a refusal's error, or EngineDeadError, raised."""
        while True:
            item = await self.queue.get()
            if isinstance(item, Rejected):
                self.ended = True
                raise item.error
            if isinstance(item, BaseException):
                raise EngineDeadError("the engine stopped while serving this request") from item
            self.ended = item.finished
            yield item
            if item.finished:
                return


class StreamingClient:
    """What both serving engines keep of the requests a server reads: their streams, by id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, Stream] = {}

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def _read(self, request_id: str, stream: Stream) -> AsyncIterator[RequestOutput]:
        """``stream``'s outputs; a reader that stops before the end aborts the request."""
        try:
            async for out in stream.outputs():
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not stream.ended:
                self.abort(request_id)


class AsyncEngine(StreamingClient):
    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.task = engine.task
        self.pooling = engine.pooling
        self.embedding_size = engine.model_config.hidden_size
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._pending = 0  # submitted but not yet seen by the loop (counts as waiting)
        self._embeddings: set[asyncio.Future] = set()  # embedding calls awaiting the loop
        # The thread holds the engine through a weak reference: dropping the last reference
        # to it ends the loop and frees the model (see __del__).
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._stopping),
                                        name="kvship-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    # -- client side -------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                       final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come (with ``lora_request``'s adapter, if given); with
        ``final_only``, its one final output (an answer sent whole). ``arrival_time``
        (time.monotonic()): when the server accepted it, before tokenizing; default now. Queue
        time, TTFT and latency count from there, so they include the wait for the engine thread
        and the server's own work."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._check_accepting()
        stream = Stream(asyncio.get_running_loop())
        with self._lock:
            self._streams[request_id] = stream
            self._pending += 1
        self._inbox.put(("add", (request_id, list(prompt_token_ids), params, arrival_time, lora_request, final_only)))
        async for out in self._read(request_id, stream):
            yield out

    def _check_accepting(self) -> None:
        """EngineDeadError once the loop has died; QueueFullError while the waiting queue is full."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine has stopped") from self._error
        if self.stats().num_requests_waiting >= self.config.max_waiting_requests:
            raise QueueFullError(f"the server has {self.config.max_waiting_requests} requests waiting; retry later")

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    async def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Compile an output constraint in a worker thread, so that the engine thread finds it
        compiled when the request arrives (compiling a large JSON schema takes milliseconds to
        seconds). InvalidParamsError when xgrammar cannot serve it."""
        await asyncio.to_thread(self.engine.grammars.prepare, spec)

    async def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Pooled embeddings of the prompts (LLMEngine.embed), computed on the engine thread
        between steps. Raises QueueFullError / EngineDeadError / InvalidParamsError."""
        self._check_accepting()
        loop = asyncio.get_running_loop()
        result: asyncio.Future[list[torch.Tensor]] = loop.create_future()
        with self._lock:
            self._pending += 1
            self._embeddings.add(result)
        try:
            self._inbox.put(("embed", (prompts, loop, result)))
            return await result
        finally:
            with self._lock:
                self._embeddings.discard(result)

    def add_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future:
        """Read and check an adapter on the engine thread (LLMEngine.add_lora); the future fails
        with InvalidParamsError naming what cannot be served."""
        self._check_accepting()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("lora", (lora_request, done)))
        return done

    def stats(self) -> EngineStats:
        return engine_stats(self.engine, self._pending)

    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        self._death_callbacks.append(fn)

    def shutdown(self, timeout: float = 10.0, release_memory: bool = True) -> None:
        """Stop the engine thread, then the engine: its tensor-parallel ranks and, with
        ``release_memory``, its device memory (LLMEngine.shutdown). Safe to call twice."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():  # a step still runs: freeing under it would break it
                log.warning("the engine thread did not stop within %.0f s; its memory is not released", timeout)
                return
        if hasattr(self.engine, "shutdown"):  # TP ranks stop once no step runs
            self.engine.shutdown(release_memory=release_memory)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self.shutdown(release_memory=False)  # the model goes with the last reference to it

    # -- engine thread -----------------------------------------------------------------------
    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                request_id, ids, params, arrival_time, lora_request, final_only = arg
                with self._lock:
                    self._pending -= 1
                    stream = self._streams.get(request_id)
                try:
                    self.engine.add_request(request_id, ids, params, arrival_time, lora_request, final_only)
                except Exception as e:  # a client mistake: hand it back to the caller
                    if stream is not None:
                        stream.put(Rejected(e))
            elif kind == "embed":
                prompts, loop, result = arg
                with self._lock:
                    self._pending -= 1
                try:
                    value, error = self.engine.embed(prompts), None
                except InvalidParamsError as e:  # a client mistake: hand it back to the caller
                    value, error = None, e
                loop.call_soon_threadsafe(settle, result, value, error)
            elif kind == "lora":
                lora_request, done = arg
                try:
                    self.engine.add_lora(lora_request)
                    done.set_result(None)
                except Exception as e:  # a bad adapter: the caller says why
                    done.set_exception(e)
            elif kind == "abort":
                final = self.engine.abort(arg)
                with self._lock:
                    stream = self._streams.get(arg)
                if final is not None and stream is not None:  # a reader is still waiting: end its stream
                    stream.put(final)

    def _iterate(self) -> bool:
        """One turn of the loop: take what the clients sent, run a step if there is work, hand
        its outputs out. False once the loop has died."""
        try:
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                return True
            for out in self.engine.step():
                with self._lock:
                    stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
            return True
        except BaseException as e:  # noqa: BLE001 - any failure kills serving; report it
            log.exception("engine loop died")
            self._error = e
            with self._lock:
                streams = list(self._streams.values())
                embeddings = list(self._embeddings)
            for s in streams:
                s.put(e)
            for f in embeddings:
                f.get_loop().call_soon_threadsafe(settle, f, None, EngineDeadError("the engine stopped"))
            for fn in self._death_callbacks:
                fn(e)
            return False


def _run(ref: weakref.ref, stopping: threading.Event) -> None:
    """The engine thread: turns of AsyncEngine's loop while it is referenced and not stopped."""
    while not stopping.is_set():
        engine = ref()
        if engine is None or not engine._iterate():
            return
        del engine  # between turns only the weak reference holds it


def settle(result: asyncio.Future, value: object, error: BaseException | None) -> None:
    """Hand a call awaiting the engine its result (on its event loop); a caller gone meanwhile is skipped."""
    if result.done():
        return
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(value)
