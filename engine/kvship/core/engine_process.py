"""The engine in a process of its own (``kvship serve --engine-process``), as the server's EngineClient.

The server's process keeps the HTTP work (parsing, chat templates, tokenizing, JSON); a child
process, started with ``spawn``, builds the LLMEngine and runs its step loop. Each has its own
interpreter lock, so at many connections the event loop and the step loop stop waiting on each
other (as vLLM's engine core and SGLang's scheduler run apart from their HTTP servers).

They talk over one pipe in pickled tuples. To the engine: ("add", ...), ("abort", id), ("lora",
call, request), ("embed", call, prompts), ("grammar", call, spec), ("stop",). From it: ("ready",
info) or ("failed", error) once, then ("step", outputs, stats, adds seen) after each step (or when
only the queue changed; outputs without their cumulative parts, core/output_pipe.py), ("rejected",
id, error), ("done", call, value, error). A pipe that closes ends the other side: the child when
the server dies, the server's streams when the child does.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import torch

from kvship.config import EngineConfig
from kvship.core.async_engine import (
    EngineDeadError,
    EngineStats,
    QueueFullError,
    Rejected,
    Stream,
    StreamingClient,
    settle,
)
from kvship.core.engine_process_main import engine_main
from kvship.core.output_pipe import OutputUnpacker
from kvship.lora_request import LoRARequest
from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams, StructuredOutput

log = logging.getLogger(__name__)


class PipeStream(Stream):
    """A request's stream, with what makes its outputs whole again (core/output_pipe.py)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_token_ids: list[int]):
        super().__init__(loop)
        self.unpacker = OutputUnpacker(prompt_token_ids)


class ProcessEngine(StreamingClient):
    def __init__(self, config: EngineConfig, log_level: int | None = None, start_timeout: float | None = None):
        super().__init__()
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child = ctx.Pipe()
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        # daemonic: a server that exits without shutdown() takes it along (its ranks are Popen'd, not mp children)
        self._proc = ctx.Process(target=engine_main, args=(config, child, level), name="kvship-engine", daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child only: its exit closes the pipe
        if not self._conn.poll(start_timeout):
            self._kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout:g} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._proc.exitcode})") from None
        if kind == "failed":
            self._proc.join(10)
            raise info
        self.config: EngineConfig = info["config"]
        self.tokenizer = info["tokenizer"]
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.sampling_defaults = info["sampling_defaults"]
        self.task: str = info["task"]
        self.pooling = info["pooling"]
        self.embedding_size: int = info["embedding_size"]
        self._stats: EngineStats = info["stats"]
        self._send_lock = threading.Lock()
        self._calls: dict[int, Callable[[object, BaseException | None], None]] = {}  # awaiting a "done"
        self._call_ids = itertools.count()
        self._adds_sent = 0  # adds the child has not counted yet are waiting too
        self._adds_seen = 0
        self._error: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._stopping = False
        self._reader = threading.Thread(target=self._read_pipe, name="kvship-engine-pipe", daemon=True)
        self._reader.start()

    # -- the EngineClient surface -------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                       final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate; ``arrival_time`` is time.monotonic(), the same clock in both
        processes."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._check_accepting()
        ids = list(prompt_token_ids)
        stream = PipeStream(asyncio.get_running_loop(), ids)
        with self._lock:
            self._streams[request_id] = stream
            self._adds_sent += 1
        self._send(("add", request_id, ids, params, arrival_time, lora_request, final_only))
        async for out in self._read(request_id, stream):
            yield out

    def abort(self, request_id: str) -> None:
        if self._error is None:
            self._send(("abort", request_id))

    def add_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future:
        self._check_accepting()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._call("lora", lora_request, lambda value, error: done.set_exception(error) if error else
                   done.set_result(None))
        return done

    async def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        self._check_accepting()
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        self._call("embed", prompts, lambda value, error: loop.call_soon_threadsafe(settle, result, value, error))
        arrays = await result
        return [torch.from_numpy(a) for a in arrays]

    async def prepare_grammar(self, spec: StructuredOutput) -> None:
        """Compiled in the engine's process (a thread there), where requests will find it."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future = loop.create_future()
        self._call("grammar", spec, lambda value, error: loop.call_soon_threadsafe(settle, result, value, error))
        await result

    def stats(self) -> EngineStats:
        with self._lock:
            pending = self._adds_sent - self._adds_seen
        stats = self._stats
        return replace(stats, num_requests_waiting=stats.num_requests_waiting + pending)

    def is_alive(self) -> bool:
        return self._error is None and self._proc.is_alive()

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        self._death_callbacks.append(fn)

    def shutdown(self, timeout: float = 10.0, release_memory: bool = True) -> None:
        """Ask the engine process to stop (it frees its device memory as it exits), then end it
        if it has not within ``timeout``. Safe to call twice."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass  # already gone
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; ending it", timeout)
            self._kill()
        self._conn.close()

    def __enter__(self) -> "ProcessEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- this process's side of the pipe --------------------------------------------------------
    def _check_accepting(self) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine has stopped") from self._error
        if self.stats().num_requests_waiting >= self.config.max_waiting_requests:
            raise QueueFullError(f"the server has {self.config.max_waiting_requests} requests waiting; retry later")

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _call(self, kind: str, payload: object, reply: Callable[[object, BaseException | None], None]) -> None:
        """Send ``(kind, call, payload)``; the engine's ("done", call, ...) goes to ``reply``."""
        call = next(self._call_ids)
        with self._lock:
            self._calls[call] = reply
        self._send((kind, call, payload))

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(10)

    def _read_pipe(self) -> None:
        """The reader thread: hand each message from the engine to its stream or caller."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                if not self._stopping:
                    self._died(exc)
                return
            try:
                self._dispatch(message)
            except Exception:  # noqa: BLE001 - one caller gone wrong (its loop closed) must not end the reader
                log.exception("could not hand over the engine's %r message", message[0])

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, stats, adds_seen = message
            with self._lock:
                self._stats, self._adds_seen = stats, adds_seen
                streams = [(self._streams.get(p.output.request_id), p) for p in outputs]
            for stream, packed in streams:
                if stream is not None:
                    stream.put(stream.unpacker.unpack(packed))
        elif kind == "rejected":
            with self._lock:
                stream = self._streams.get(message[1])
            if stream is not None:
                stream.put(Rejected(message[2]))
        elif kind == "done":
            _, call, value, error = message
            with self._lock:
                reply = self._calls.pop(call, None)
            if reply is not None:
                reply(value, error)

    def _died(self, cause: BaseException) -> None:
        """The pipe closed under a running server: the death is reported (callbacks), then every
        stream and call waiting on the engine fails with it."""
        self._proc.join(5)
        error = EngineDeadError(f"the engine process exited (exit code {self._proc.exitcode})")
        error.__cause__ = cause
        log.error("%s", error)
        self._error = error
        for fn in self._death_callbacks:
            fn(error)
        with self._lock:
            streams, calls = list(self._streams.values()), list(self._calls.values())
            self._calls.clear()
        for s in streams:
            s.put(error)
        for reply in calls:
            reply(None, error)
