"""The built-in chat page: `/` serves a small single-page chat client, its assets live under
`/static/chat/`. Everything ships in the package (engine/kvship/server/static/); nothing is loaded
from another origin, and a Content-Security-Policy header keeps it that way.

The page only talks to the public API (/v1/models, /v1/chat/completions), so it needs no
server-side state and works behind `--api-key` (the key is typed into the page).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.responses import HTMLResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent / "static"
ASSET_PREFIX = "/static/chat"

# The page needs nothing from elsewhere; inline script and style are refused, so a rendering
# bug that let model output become markup still could not run code.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class _Assets(StaticFiles):
    """StaticFiles that revalidates (assets change with the package, not with a hash in the name)."""

    async def get_response(self, path: str, scope: Any) -> Response:
        response = await super().get_response(path, scope)
        response.headers.setdefault("Cache-Control", "no-cache")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response


def mount_chat_page(app: Any, enabled: bool) -> None:
    """Serve the chat page at `/` and its assets under /static/chat/ when `enabled`; when not,
    nothing is added and `/` answers 404."""
    if not enabled:
        return
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")

    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    app.add_api_route("/", chat_page, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount(ASSET_PREFIX, _Assets(directory=STATIC_DIR), name="chat-static")
