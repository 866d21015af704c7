"""gpt-oss's output in OpenAI's harmony format (--reasoning-parser harmony), as an assistant message.

The prompt ends with ``<|start|>assistant``; the model then writes messages, each a header,
``<|message|>``, a body and a terminator::

    <|channel|>analysis<|message|>thinking<|end|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The header names the channel and, for a tool call, the recipient (``to=functions.NAME``, before
or after the channel). ``analysis`` bodies are the reasoning (``reasoning_content``), ``final``
bodies and ``commentary`` without a recipient (preambles) the content, and a body addressed to
``functions.NAME`` a tool call whose arguments are the body (only when the request gave tools;
otherwise its text is content). ``<|return|>`` and ``<|call|>`` end generation, so the output's
end also ends a message. The markers are special tokens: the server keeps them in the text
(skip_special_tokens off). Output that does not open with a marker is content as it is."""
from __future__ import annotations

import re

from kvship.core.stop import held_back
from kvship.server.tools import Call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>", START)
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *TERMINATORS)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyStream:
    """Generated text in, (reasoning delta, content delta, new tool calls) out. ``tools``: whether
    the request gave tools (calls are parsed only then)."""

    def __init__(self, tools: bool):
        self.tools = tools
        self.calls: list[Call] = []
        self._buf = ""
        self._state = "start"  # start -> header <-> body; or start -> plain (not harmony)
        self._channel, self._recipient = "", None

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[Call]]:
        self._buf += text
        reasoning, content, calls = [], [], []
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if not head or (not final and any(m.startswith(head) for m in MARKERS)):
                    break  # could still open with a marker
                self._state = "header" if head.startswith(MARKERS) else "plain"
                self._buf = head
            if self._state == "plain":
                content.append(self._buf)
                self._buf = ""
                break
            if self._state == "header":
                end = self._buf.find(MESSAGE)
                if end < 0:
                    if final:  # a header the output ended inside: nothing to show
                        self._buf = ""
                    break
                self._header(self._buf[:end])
                self._buf, self._state = self._buf[end + len(MESSAGE):], "body"
            ends = [(i, t) for t in TERMINATORS if (i := self._buf.find(t)) >= 0]
            if not ends and not final:
                if not self._is_call():  # a call's arguments come out whole, at its end
                    keep = held_back(self._buf, list(TERMINATORS))
                    self._route(self._buf[:len(self._buf) - keep], reasoning, content)
                    self._buf = self._buf[len(self._buf) - keep:]
                break
            i, term = min(ends) if ends else (len(self._buf), "")
            body, self._buf = self._buf[:i], self._buf[i + (0 if term == START else len(term)):]
            if self._is_call():
                call = Call(self._recipient.removeprefix("functions."), body.strip() or "{}")
                self.calls.append(call)
                calls.append(call)
            else:
                self._route(body, reasoning, content)
            self._state = "header"
            if not ends:
                break
        return "".join(reasoning), "".join(content), calls

    def end(self) -> tuple[str, str, list[Call]]:
        return self.feed("", final=True)

    def _header(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None

    def _is_call(self) -> bool:
        return self.tools and self._recipient is not None and self._recipient.startswith("functions.")

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        builtin = self._recipient is not None and not self._recipient.startswith("functions.")
        if self._channel == "analysis" or builtin:
            reasoning.append(text)  # thinking, and messages to built-in tools (browser, python)
        else:
            content.append(text)
