"""One chat choice's generated text as OpenAI's assistant message: the thinking
(`reasoning_content`, server/reasoning.py), the answer (`content`) and the tool calls
(server/tools.py), whole or as stream deltas. gpt-oss's harmony format carries all three in one
syntax (server/harmony.py): its parser replaces the other two, except for required and named
calls, whose constrained output is bare JSON for ToolStream."""
from __future__ import annotations

from kvship.server.harmony import HarmonyStream
from kvship.server.reasoning import ReasoningStream
from kvship.server.tools import Call, ToolPlan, ToolStream


class MessageShaper:
    def __init__(self, reasoning_parser: str | None, plan: ToolPlan | None):
        self.harmony = None
        if reasoning_parser == "harmony" or (plan is not None and plan.parser == "harmony"):
            self.harmony = HarmonyStream(tools=plan is not None and plan.mode == "auto")
            plan = None if plan is not None and plan.mode == "auto" else plan
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser and self.harmony is None else None
        self.tools = ToolStream(plan) if plan is not None else None

    @property
    def calls(self) -> list[Call]:
        return (self.harmony.calls if self.harmony is not None else []) + (self.tools.calls if self.tools else [])

    def _split(self, text: str, final: bool) -> tuple[str, str, list[dict[str, object]]]:
        calls: list[dict[str, object]] = []
        if self.harmony is not None:
            before = len(self.harmony.calls)
            reasoning, content, new = self.harmony.feed(text, final=final)
            calls = [{"index": before + i, **c.json()} for i, c in enumerate(new)]
        elif self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, final=final)
        else:
            reasoning, content = "", text
        if self.tools is not None:
            content, calls = self.tools.feed(content) if content else ("", [])
            if final:
                more, end_calls = self.tools.end()
                content, calls = content + more, calls + end_calls
        return reasoning, content, calls

    def delta(self, text: str, final: bool = False) -> dict[str, object]:
        """The stream delta for newly generated text (`final`: the choice ended; what was held
        back comes out). Empty when nothing can be shown yet."""
        reasoning, content, calls = self._split(text, final)
        out: dict[str, object] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict[str, object]:
        """The whole message of a finished choice."""
        r1, c1, _ = self._split(text, final=False)
        r2, c2, _ = self._split("", final=True)
        called = bool(self.calls)
        msg: dict[str, object] = {"role": "assistant", "content": (c1 + c2) or (None if called else ""),
                                  "refusal": None}
        if self.reasoning is not None or self.harmony is not None:
            msg["reasoning_content"] = (r1 + r2) or None
        if called:
            msg["tool_calls"] = [c.json() for c in self.calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a choice that called tools and ended on its own."""
        if reason == "stop" and self.calls:
            return "tool_calls"
        return reason
