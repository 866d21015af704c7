"""Separating a reasoning model's thinking from its answer (--reasoning-parser), as vLLM's
parsers of the same names do: the thinking goes to `reasoning_content`, the rest to `content`.

- qwen3: thinking only when the output opens with <think>; it runs to </think>. Without
  <think> (e.g. chat_template_kwargs {"enable_thinking": false}) everything is the answer.
- deepseek_r1: the prompt already opened <think>, so the output starts in the thinking (an
  opening <think>, if the model writes one, is dropped) and the answer follows </think>; an
  output that never closes it is all thinking.
"""
from __future__ import annotations

from kvship.core.stop import held_back

OPEN, CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Generated text in, (reasoning delta, content delta) out."""

    def __init__(self, parser: str):
        self.parser = parser
        self._state = "start"  # start -> thinking -> after (</think> seen) -> answer; or start -> answer
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(OPEN):
                self._buf, self._state = head[len(OPEN):], "thinking"
            elif OPEN.startswith(head) and head and not final:
                return "", ""  # could still be <think>
            else:
                self._state = "thinking" if self.parser == "deepseek_r1" else "answer"
        if self._state == "thinking":
            end = self._buf.find(CLOSE)
            if end < 0:
                keep = 0 if final else held_back(self._buf, [CLOSE])
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(CLOSE):], "after"
        if self._state == "after":  # the newlines between </think> and the answer are neither
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return reasoning, ""
            self._state = "answer"
        if self._state == "answer":
            content, self._buf = self._buf, ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        return self.feed("", final=True)
