"""Stop strings, matched on the detokenized text as it streams in.

A stop string may straddle any number of pushes, so the matcher holds back the longest
suffix of the pending text that could still grow into a stop string; everything before it
is safe to emit. On a match the output ends just before the stop string (which is not part of
the output), and nothing more comes out.
"""
from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", None
        if not self.stop:
            return new_text, None
        buf = self._held + new_text
        # A match cannot start in text already emitted: that text never ended in a proper
        # prefix of a stop string. So searching the held + new text is enough.
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)  # earliest position wins; ties go to the first listed
        if best is not None:
            self._held = ""
            self.matched = best[1]
            return buf[: best[0]], best[1]
        hold = self._holdback(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], None

    def _holdback(self, buf: str) -> int:
        return held_back(buf, self.stop, self._max_hold)

    def flush(self) -> str:
        """At the end (length / eos finish): releases the held-back text."""
        if self.matched is not None:
            return ""
        out, self._held = self._held, ""
        return out


def held_back(text: str, markers: list[str], longest: int | None = None) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (what a
    streaming scanner must hold back: the next delta may complete the marker). `longest`: the
    longest marker's length less one, when the caller has it."""
    if longest is None:
        longest = max((len(m) for m in markers), default=1) - 1
    for k in range(min(len(text), longest), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0
