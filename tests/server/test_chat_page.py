"""The built-in chat page, end to end: the real `kvship serve` (bundled SmolLM2 on the CPU) driven
by Debian's headless Chromium through Playwright.

Chromium comes from `bash .ci/browser.sh install` (CI runs it); when it is missing these tests
fail rather than skip. Playwright only drives /usr/bin/chromium and never downloads a browser.
A screenshot of a finished answer is written to a temporary file (its path is printed) for a
person to look at.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from server_utils import start_server

CHROMIUM = os.environ.get("KVSHIP_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STREAM_TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.fail(f"{CHROMIUM} not found: install it with `bash .ci/browser.sh install`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    with sync_playwright() as p:
        # Playwright gives every launch a fresh, empty user-data dir; headless is its default.
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-model-len", "2048")
    try:
        yield s
    finally:
        s.stop()


class Page:
    """A fresh browser context on the chat page, with page errors collected. Predicates given
    to wait_for_function are written as functions: the page's CSP forbids eval of strings."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1200, "height": 820})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on(
            "console", lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None
        )
        self.page.goto(url + "/")

    def wait_model(self) -> str:
        self.page.wait_for_function(
            "() => document.getElementById('model-name').dataset.state === 'ready'", timeout=15_000
        )
        return self.page.inner_text("#model-name")

    def ask(self, text: str) -> None:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")

    def answer_text(self) -> str:
        return self.page.inner_text(".msg-assistant >> nth=-1 >> .body")

    def answer_state(self) -> str:
        return self.page.get_attribute(".msg-assistant >> nth=-1", "data-state") or ""

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def chat(browser, server):
    p = Page(browser, server.url)
    yield p
    p.close()


def test_streamed_answer_with_usage(chat, server, record_property):
    assert chat.wait_model() == "SmolLM2-135M-Instruct"
    assert chat.page.title().startswith("SmolLM2-135M-Instruct")
    chat.page.fill("#system-prompt", "You are a helpful assistant. Answer with a short Python example.")
    chat.page.fill("#max-tokens", "200")

    t0 = time.monotonic()
    chat.ask("How do I reverse a list in Python?")
    # The answer grows while it streams: sample its length until it is done.
    lengths: list[int] = []
    chat.page.wait_for_selector(".msg-assistant[data-state=streaming]", timeout=STREAM_TIMEOUT_MS)
    while chat.answer_state() == "streaming" and time.monotonic() - t0 < STREAM_TIMEOUT_MS / 1000:
        lengths.append(len(chat.answer_text()))
        time.sleep(0.15)
    chat.page.wait_for_selector(".msg-assistant[data-state=done]", timeout=STREAM_TIMEOUT_MS)
    elapsed = time.monotonic() - t0

    # (Rendered Markdown may shrink by a character when a `**` or fence completes, so growth is
    # counted, not required at every sample.)
    growths = sum(1 for a, b in zip(lengths, lengths[1:]) if b > a)
    assert growths >= 3 and lengths[-1] > lengths[0], f"the answer did not grow while streaming: {lengths}"
    assert len(chat.answer_text()) > 0

    # The user's turn is shown as typed, the composer is cleared and usable again.
    assert chat.page.inner_text(".msg-user .body") == "How do I reverse a list in Python?"
    assert chat.page.input_value("#prompt") == ""
    assert chat.page.is_enabled("#send") and chat.page.is_hidden("#stop")

    meta = chat.page.inner_text(".msg-assistant .meta")
    assert "prompt" in meta and "completion" in meta and "tokens" in meta, meta
    assert "completion" in chat.page.inner_text("#usage")

    shot = Path(tempfile.mkdtemp(prefix="kvship-chat-")) / "chat.png"
    # Written here, not by Playwright (screenshot(path=...)): Playwright writes files from its
    # event loop's thread pool, whose threads outlive the test; under load it started a second
    # one, which the leak check rightly reported.
    shot.write_bytes(chat.page.screenshot())
    record_property("answer streamed", f"in {elapsed:.1f}s ({len(lengths)} samples); screenshot: {shot}")

    # A second turn carries the conversation.
    chat.page.fill("#max-tokens", "40")
    chat.ask("Thanks! Now in one sentence: what does it return?")
    chat.page.wait_for_function(
        "() => document.querySelectorAll('.msg-assistant[data-state=done]').length === 2", timeout=STREAM_TIMEOUT_MS
    )
    assert chat.page.locator(".msg-user").count() == 2
    assert chat.errors == []


def test_keyboard_and_labels(chat):
    chat.wait_model()
    # Every control has a label; the prompt has focus on load.
    unlabelled = chat.page.evaluate(
        "() => [...document.querySelectorAll('input, textarea, select')]"
        ".filter(e => !e.labels || e.labels.length === 0).map(e => e.id)"
    )
    assert unlabelled == []
    assert chat.page.evaluate("() => document.activeElement.id") == "prompt"
    # Shift+Enter is a newline, Enter on an empty prompt sends nothing.
    chat.page.keyboard.type("first line")
    chat.page.keyboard.press("Shift+Enter")
    chat.page.keyboard.type("second line")
    assert chat.page.input_value("#prompt") == "first line\nsecond line"
    assert chat.page.locator(".msg").count() == 0
    chat.page.fill("#prompt", "   ")
    chat.page.keyboard.press("Enter")
    assert chat.page.locator(".msg").count() == 0
    # Settings persist across a reload.
    chat.page.fill("#system-prompt", "Be brief.")
    chat.page.fill("#max-tokens", "77")
    chat.page.reload()
    chat.wait_model()
    assert chat.page.input_value("#system-prompt") == "Be brief."
    assert chat.page.input_value("#max-tokens") == "77"
    assert chat.errors == []


def test_stop_aborts_the_request(chat, server):
    chat.wait_model()
    chat.page.fill("#max-tokens", "1800")
    chat.ask("Write a very long story about a dragon and a knight, in many chapters with long paragraphs.")

    # Wait until it is really generating: text on the page and one request running.
    chat.page.wait_for_function(
        "() => { const b = document.querySelector('.msg-assistant .body');"
        " return b && b.innerText.length > 40; }",
        timeout=STREAM_TIMEOUT_MS,
    )
    assert chat.answer_state() == "streaming"
    assert server.metrics()["kvship:num_requests_running"] == 1
    assert chat.page.is_visible("#stop")

    chat.page.click("#stop")
    chat.page.wait_for_selector(".msg-assistant[data-state=stopped]", timeout=10_000)
    server.wait_metric("kvship:num_requests_running", lambda v: v == 0, timeout=15)

    stopped_at = chat.answer_text()
    time.sleep(1.5)
    assert chat.answer_text() == stopped_at, "the answer kept growing after Stop"
    assert "stopped" in chat.page.inner_text(".msg-assistant .meta")
    assert chat.page.is_enabled("#send") and chat.page.is_hidden("#stop")
    assert server.metrics()["kvship:num_requests_running"] == 0
    assert chat.errors == []


def test_server_errors_are_shown(chat, server):
    chat.wait_model()
    chat.page.fill("#max-tokens", "100000")
    chat.ask("Hello")
    chat.page.wait_for_selector(".msg-assistant[data-state=error]", timeout=STREAM_TIMEOUT_MS)
    alert = chat.page.inner_text(".msg-assistant [role=alert]")
    assert "Error 400" in alert and "maximum context length is 2048 tokens" in alert, alert
    # A failed turn is not sent back as part of the conversation; the next one works.
    chat.page.fill("#max-tokens", "3")
    chat.ask("Count from 1 to 100.")
    chat.page.wait_for_function(
        "() => document.querySelectorAll('.msg-assistant[data-state=done]').length === 1", timeout=STREAM_TIMEOUT_MS
    )
    assert chat.page.is_hidden("#error")
    assert "cut off at the max-tokens limit" in chat.page.inner_text(".msg-assistant >> nth=-1 >> .meta")


MARKDOWN_CASES = {
    # source: (selectors that must exist in the output, text that must be shown literally)
    "```python\nprint('<b>hi</b>')\n```": (["div.code-block pre code.language-python"], "print('<b>hi</b>')"),
    "**bold** and *it* and `x<y`": (["strong", "em", "code"], "x<y"),
    "# Title\n\n- one\n- two\n  - nested\n\n1. first\n2. second": (["h3", "ul li ul li", "ol li"], "nested"),
    "| a | b |\n|---|--:|\n| 1 | 2 |": (["table thead th", "td.align-right"], "2"),
    "> quoted": (["blockquote p"], "quoted"),
    "[site](https://example.com)": (["a[href='https://example.com'][rel='noopener noreferrer']"], "site"),
    "unclosed fence while streaming\n```js\nlet a = 1;": (["pre code.language-js"], "let a = 1;"),
}

INJECTIONS = [
    "<img src=x onerror=\"window.__pwned=1\">",
    "<script>window.__pwned=1</script>",
    "[click](javascript:window.__pwned=1)",
    "[x](https://a.example/\" onmouseover=\"window.__pwned=1)",
    "```\n</code></pre><img src=x onerror=window.__pwned=1>\n```",
    "`<img src=x onerror=window.__pwned=1>`",
    "**<svg onload=window.__pwned=1>**",
    "| <img src=x onerror=window.__pwned=1> |\n|---|\n| b |",
    "```\" onmouseover=\"window.__pwned=1\nx\n```",
]


def test_markdown_rendering_and_escaping(chat):
    chat.wait_model()
    for source, (selectors, literal) in MARKDOWN_CASES.items():
        result = chat.page.evaluate(
            """([src, sels]) => {
                const d = document.createElement('div');
                d.innerHTML = window.kvshipMarkdown.render(src);
                return {found: sels.map(s => !!d.querySelector(s)), text: d.textContent, html: d.innerHTML};
            }""",
            [source, selectors],
        )
        assert all(result["found"]), (source, selectors, result["html"])
        assert literal in result["text"], (source, result["html"])

    for source in INJECTIONS:
        result = chat.page.evaluate(
            """async (src) => {
                const d = document.createElement('div');
                document.body.appendChild(d);
                d.innerHTML = window.kvshipMarkdown.render(src);
                await new Promise(r => setTimeout(r, 50));
                const bad = d.querySelectorAll('img, script, svg, iframe, [onerror], [onload], [onmouseover], a[href^="javascript"]');
                const out = {bad: bad.length, pwned: !!window.__pwned, html: d.innerHTML};
                d.remove();
                return out;
            }""",
            source,
        )
        assert result["bad"] == 0 and not result["pwned"], (source, result["html"])


def test_api_key_is_asked_for_and_used(browser):
    server = start_server("--max-model-len", "2048", "--api-key", "sesame-123")
    chat = Page(browser, server.url)
    try:
        dialog = chat.page.locator("#key-dialog")
        dialog.wait_for(state="visible", timeout=15_000)
        assert "API key" in chat.page.inner_text("#key-reason")
        assert chat.page.get_attribute("#model-name", "data-state") == "error"

        # A wrong key: asked again, saying so.
        chat.page.fill("#api-key", "wrong")
        chat.page.press("#api-key", "Enter")
        chat.page.wait_for_function(
            "() => document.getElementById('key-reason').textContent.includes('Incorrect API key')", timeout=15_000
        )
        assert dialog.is_visible()

        chat.page.fill("#api-key", "sesame-123")
        chat.page.click("#key-save")
        assert chat.wait_model() == "SmolLM2-135M-Instruct"
        assert dialog.is_hidden()
        assert chat.page.evaluate("localStorage.getItem('kvship.apiKey')") == "sesame-123"

        chat.page.fill("#max-tokens", "24")
        chat.ask("Say hello.")
        chat.page.wait_for_selector(".msg-assistant[data-state=done]", timeout=STREAM_TIMEOUT_MS)
        assert chat.answer_text().strip()
        assert "completion" in chat.page.inner_text(".msg-assistant .meta")

        # The key is remembered: a reload goes straight to the model.
        chat.page.reload()
        assert chat.wait_model() == "SmolLM2-135M-Instruct"

        # A key that stops working mid-conversation: the question is kept, the key asked for,
        # and the question sent again once it is given.
        chat.page.evaluate("localStorage.setItem('kvship.apiKey', 'stale')")
        chat.ask("Say bye.")
        dialog.wait_for(state="visible", timeout=15_000)
        assert chat.page.locator(".msg").count() == 0
        chat.page.fill("#api-key", "sesame-123")
        chat.page.press("#api-key", "Enter")
        chat.page.wait_for_selector(".msg-assistant[data-state=done]", timeout=STREAM_TIMEOUT_MS)
        assert chat.page.inner_text(".msg-user .body") == "Say bye."
        assert chat.page.input_value("#prompt") == ""
        # Page errors from the 401s are the browser's own console lines for failed fetches.
        assert [e for e in chat.errors if "401" not in e] == []
    finally:
        chat.close()
        server.stop()


def test_no_chat_page_flag():
    server = start_server("--max-model-len", "2048", "--no-chat-page")
    try:
        assert httpx.get(server.url + "/", timeout=10).status_code == 404
        assert httpx.get(server.url + "/static/chat/chat.js", timeout=10).status_code == 404
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_page_and_assets_are_self_contained(server):
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    external = re.compile(r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?(https?:)?//|@import|fetch\(\s*["'](https?:)?//""")
    assert not external.search(page.text)
    for name in ("chat.js", "markdown.js", "chat.css"):
        r = httpx.get(f"{server.url}/static/chat/{name}", timeout=10)
        assert r.status_code == 200, name
        assert not external.search(r.text), (name, external.search(r.text))
    assert httpx.get(server.url + "/static/chat/../app.py", timeout=10).status_code == 404
