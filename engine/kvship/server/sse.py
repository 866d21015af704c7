"""Server-Sent Events: OpenAI's `data: {json}` lines, ended by `data: [DONE]`."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from kvship.server.errors import APIError, engine_error, utf8_safe
from kvship.server.generation import GenerationStream

logger = logging.getLogger("kvship.server")

SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    # utf8_safe: a chunk may echo request text (the Responses API's shell) that UTF-8 cannot encode.
    return f"data: {utf8_safe(json.dumps(data, ensure_ascii=False, separators=(',', ':')))}\n\n"


def sse_response(stream: GenerationStream, request_id: str, chunks: AsyncIterator[str]) -> StreamingResponse:
    """`chunks` as Server-Sent Events, then [DONE]. Once streaming, the status line is gone: an
    error is reported inside the stream; the engine request is closed however it ends."""
    stream.streaming = True

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
            yield SSE_DONE
        except Exception as exc:
            err = engine_error(exc) or APIError(500, f"Internal server error: {type(exc).__name__}", type="server_error")
            if err.status >= 500:
                logger.warning("stream %s failed: %r", request_id, exc)
            yield sse(err.body())
            yield SSE_DONE
        finally:
            await stream.aclose()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
