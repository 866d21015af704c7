"""Memory that requests leave behind. Large bodies are parsed in worker threads, and glibc keeps
what a thread frees in that thread's arena: every burst of large requests raised the server's
RSS for good (hundreds of MB per burst of a few 8 MB bodies). After a large request ends,
`malloc_trim` hands the freed pages back (glibc only; elsewhere nothing is done)."""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import threading
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvship.server.body import OFFLOAD_BYTES

logger = logging.getLogger("kvship.server")


def _malloc_trim():  # -> the C function, or None
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class MemoryTrimmer:
    """Runs malloc_trim in a worker thread after large requests, at most once per `interval_s`
    (a trim walks the whole heap: milliseconds per GB). A request that ends while a trim is
    pending or running gets a trim after it, so the last of a burst is never left behind; the
    wait is a timer on the event loop, so no pool thread is held through it."""

    def __init__(self, interval_s: float = 1.0):
        self._trim = _malloc_trim()
        self._interval_s = interval_s
        self._last = -interval_s
        self._lock = threading.Lock()
        self._wanted = False
        self._active = False  # a trim is scheduled or running
        self.trims = 0

    def request_done(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            self._wanted = True
            if self._active:
                return
            self._active = True
        self._schedule(asyncio.get_running_loop())

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        wait = max(0.0, self._last + self._interval_s - time.monotonic())
        loop.call_later(wait, loop.run_in_executor, None, self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._wanted = False
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
        with self._lock:
            if not self._wanted:
                self._active = False
                return
        try:  # a request ended during this trim: one more after the interval
            loop.call_soon_threadsafe(self._schedule, loop)
        except RuntimeError:  # the loop has closed (shutdown): nothing is left to trim for
            with self._lock:
                self._active = False


class TrimAfterLargeRequests:
    """ASGI middleware: a request whose body reached `threshold` bytes asks the trimmer to run
    once it is answered (its parsed body is garbage by then)."""

    def __init__(self, app: ASGIApp, trimmer: MemoryTrimmer, threshold: int = OFFLOAD_BYTES):
        self.app = app
        self.trimmer = trimmer
        self.threshold = threshold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = 0

        async def counting_receive() -> Message:
            nonlocal size
            message = await receive()
            size += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if size >= self.threshold:
                self.trimmer.request_done()
