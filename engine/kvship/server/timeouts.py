"""Time limits on reading a request, so that a client that sends slowly, or nothing at all,
cannot hold a connection (and its memory) open: one for the request line and headers, kept by
the HTTP protocol before the app sees the request, and one for the body, kept by an ASGI
middleware around `receive`. Either answers 408 and closes the connection."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvship.server.errors import APIError

logger = logging.getLogger("kvship.server")

DEFAULT_HEADER_TIMEOUT_S = 20.0  # request line and headers; also a new connection's first bytes
DEFAULT_BODY_TIMEOUT_S = 60.0  # the whole body, counted from the end of the headers
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle keep-alive connection between requests


def _408(what: str, limit_s: float) -> APIError:
    return APIError(408, f"The request's {what} did not arrive within this server's limit of {limit_s:g} seconds.",
                    code="request_timeout", headers={"Connection": "close"})


def timed_h11_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a limit on the time a request's head may take to arrive.
    uvicorn's own keep-alive timer stops at the first byte, so a head sent a byte at a time
    (or a connection that never sends one) was held open for as long as the client liked."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _app_running(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing() and not self._app_running():
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self._app_running():  # a whole head arrived: the body's limit is the middleware's
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # waiting for the next request's head (unless one was pipelined)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self._app_running():
                return
            pending, _ = self.conn.trailing_data
            client = "%s:%d" % self.client if self.client else "?"
            if self.conn.their_state is h11.IDLE and pending:  # half a head: say why it is closed
                body = json.dumps(_408("headers", header_timeout_s).body()).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                logger.info("408 to %s: no complete request head within %gs", client, header_timeout_s)
            else:  # an idle connection (a browser's preconnect, say): closed without a word
                logger.debug("closed an idle connection from %s after %gs", client, header_timeout_s)
            self.transport.close()

    return TimedH11Protocol


class BodyTimeoutMiddleware:
    """The body of a request must arrive within `timeout_s` of its headers: a `receive` that
    waits past that raises a 408 (connection closed after it). Once the body is in, `receive`
    is left alone (handlers use it to notice a client going away)."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise _408("body", self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, timed_receive, send)

