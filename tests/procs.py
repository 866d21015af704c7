"""Child processes read from Linux /proc, for tests that check nothing outlives them."""
from __future__ import annotations

from pathlib import Path


def live_children(pid: int) -> set[int]:
    """The live (not zombie) child processes of `pid`."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:  # the thread ended between the listing and the read
            pass
    return {p for p in pids if Path(f"/proc/{p}").exists() and _state(p) != "Z"}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"
