"""The engine for serving: its step loop runs in a process of its own, off the server's GIL.

With the loop in a thread of the server process, the HTTP side's Python work (an SSE chunk per
token per stream) and the engine's eager steps took turns on one GIL: on the H200 a prompt
joining 7 streaming requests waited 170 ms for its first token, against 30 ms for the engine
alone (bench/diag_burst.py `joins`, `async-joins`, bench/serve.py's server-side columns).

The server talks to it only through generate() (an async stream of outputs), abort() and
stats(). Commands (add, abort, stop) go down a pipe; each step's outputs and a stats snapshot
come back on it, read by a thread that hands them to the event loop. The engine process exits
when the pipe closes, so it never outlives the server; if it dies, the server learns it from the
same pipe. The tokenizer is loaded on both sides (the server tokenizes; the engine detokenizes).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import pickle
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from kvship.config import EngineConfig
from kvship.outputs import RequestOutput
from kvship.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    pass


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / max(1, self.num_kv_blocks_total)


@dataclass
class _Rejected:
    """add_request refused the request (a client mistake); re-raised in the caller."""

    error: Exception


class _Stream:
    """Outputs of one request, handed from the reader thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_token_ids: list[int]):
        self.loop = loop
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue[RequestOutput | _Rejected | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | _Rejected | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


# -- the engine process ----------------------------------------------------------------------

def _engine_stats(engine) -> EngineStats:
    sched, kv = engine.scheduler, engine.kv
    return EngineStats(
        num_requests_running=len({s.request_id for s in sched.running}),
        num_requests_waiting=len({s.request_id for s in sched.waiting}),
        num_kv_blocks_total=kv.num_blocks,
        num_kv_blocks_used=kv.num_used_blocks,
        num_kv_blocks_free=kv.num_free_blocks,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        num_preemptions=sched.num_preemptions,
        prompt_tokens_total=engine.prompt_tokens_total,
        generation_tokens_total=engine.generation_tokens_total,
    )


def _portable(exc: BaseException) -> Exception:
    """`exc` itself when it survives pickling (client mistakes such as InvalidParamsError do),
    otherwise a RuntimeError carrying its description."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc  # type: ignore[return-value]
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _engine_main(config: EngineConfig, conn: Connection, log_level: str) -> None:
    """The engine process: build the engine, then step while there is work, reading commands
    between steps; stop on "stop" or when the server's end of the pipe closes."""
    from kvship.core.engine import LLMEngine
    from kvship.telemetry import setup_logging

    setup_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits
        conn.send(("failed", _portable(exc)))
        return
    conn.send(("ready", dict(config=engine.config, model_name=engine.model_name,
                             max_model_len=engine.max_model_len, sampling_defaults=engine.sampling_defaults,
                             stats=_engine_stats(engine))))
    adds_seen = 0
    try:
        while True:
            outputs: list[RequestOutput] = []
            touched = False
            # Block for a command only when idle with nothing to report; else take what is there.
            while conn.poll(0 if touched or engine.has_work() else None):
                kind, arg = conn.recv()
                touched = True
                if kind == "stop":
                    return
                if kind == "add":
                    request_id, ids, params = arg
                    adds_seen += 1
                    try:
                        engine.add_request(request_id, ids, params)
                    except Exception as exc:  # a client mistake: handed back to the caller
                        conn.send(("rejected", (request_id, _portable(exc))))
                elif kind == "abort":
                    final = engine.abort(arg)
                    if final is not None:
                        outputs.append(final)
            if engine.has_work():
                outputs += engine.step()
                touched = True
            if touched:
                for out in outputs:  # the server has the prompt; don't ship it back every step
                    out.prompt_token_ids = []
                conn.send(("step", (outputs, _engine_stats(engine), adds_seen)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone
    except BaseException as exc:  # noqa: BLE001 - the server must learn why, then restart us
        log.exception("engine loop died")
        try:
            conn.send(("dead", _portable(exc)))
        except (OSError, EOFError):
            pass
        raise SystemExit(1) from None
    finally:
        engine.shutdown()


# -- the server side -------------------------------------------------------------------------

class AsyncEngine:
    def __init__(self, config: EngineConfig, start_timeout: float | None = None):
        from kvship.loader import resolve_model

        ctx = mp.get_context("spawn")  # CUDA must not be initialised in a forked child
        self._conn, child_conn = ctx.Pipe()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        # Not a daemon: with tensor parallelism the engine starts the other ranks itself.
        self._proc = ctx.Process(target=_engine_main, args=(config, child_conn, level), name="kvship-engine")
        self._proc.start()
        child_conn.close()
        try:  # the server's tokenizer, loaded while the engine loads the weights
            self.tokenizer = resolve_model(config.model, revision=config.revision, download_dir=config.download_dir,
                                           require_weights=False).tokenizer
        except BaseException:
            self._proc.kill()
            self._proc.join(10)
            raise
        kind, info = self._recv_ready(start_timeout)
        if kind != "ready":
            self._proc.join(10)
            raise info
        self.config: EngineConfig = info["config"]
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.sampling_defaults: dict = info["sampling_defaults"]
        self._stats: EngineStats = info["stats"]
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # _streams, the pending count, and sends on the pipe
        self._adds_sent = 0
        self._adds_seen = 0
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read_loop, name="kvship-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(config)

    def _recv_ready(self, timeout: float | None):
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                return "failed", RuntimeError(f"the engine process exited with code {self._proc.exitcode} "
                                              "while loading (see the log above)")
            if timeout is not None and (timeout := timeout - 1.0) <= 0:
                self._proc.kill()
                return "failed", TimeoutError("the engine did not start in time")
        try:
            return self._conn.recv()
        except EOFError:
            self._proc.join(10)
            return "failed", RuntimeError(f"the engine process exited with code {self._proc.exitcode} while loading")

    def _send(self, kind: str, arg: object) -> None:
        with self._lock:
            self._conn.send((kind, arg))

    # -- client side -------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.is_alive():
            raise EngineDeadError("the engine has stopped") from self._error
        if self.stats().num_requests_waiting >= self.config.max_waiting_requests:
            raise QueueFullError(f"the server has {self.config.max_waiting_requests} requests waiting; retry later")
        ids = list(prompt_token_ids)
        stream = _Stream(asyncio.get_running_loop(), ids)
        with self._lock:
            self._streams[request_id] = stream
            self._adds_sent += 1
            try:
                self._conn.send(("add", (request_id, ids, params)))
            except OSError as exc:
                self._streams.pop(request_id, None)
                raise EngineDeadError("the engine has stopped") from exc
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, _Rejected):
                    finished = True
                    raise item.error
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine stopped while serving this request") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        try:
            self._send("abort", request_id)
        except OSError:
            pass  # the engine is gone: nothing left to abort

    def stats(self) -> EngineStats:
        """The engine's last reported state; requests sent but not yet seen count as waiting."""
        with self._lock:
            pending = self._adds_sent - self._adds_seen
            return replace(self._stats, num_requests_waiting=self._stats.num_requests_waiting + pending)

    def is_alive(self) -> bool:
        return self._error is None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    def add_death_callback(self, fn: Callable[[BaseException], None]) -> None:
        self._death_callbacks.append(fn)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        try:
            self._send("stop", None)
        except OSError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0fs; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    # -- reader thread -----------------------------------------------------------------------
    def _read_loop(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                kind, arg = self._conn.recv()
                if kind == "step":
                    outputs, stats, adds_seen = arg
                    with self._lock:
                        self._stats, self._adds_seen = stats, adds_seen
                        streams = [(out, self._streams.get(out.request_id)) for out in outputs]
                    for out, stream in streams:
                        if stream is not None:
                            out.prompt_token_ids = stream.prompt_token_ids
                            stream.put(out)
                elif kind == "rejected":
                    request_id, exc = arg
                    with self._lock:
                        stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(_Rejected(exc))
                elif kind == "dead":
                    error = arg
                    break
        except (EOFError, OSError) as exc:
            error = exc
        if self._stopping:
            return
        self._proc.join(5)
        if error is None or isinstance(error, (EOFError, OSError)):
            error = RuntimeError(f"the engine process exited (code {self._proc.exitcode})")
        log.error("engine loop died: %s", error)
        self._error = error
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.put(error)
        for fn in self._death_callbacks:
            fn(error)
