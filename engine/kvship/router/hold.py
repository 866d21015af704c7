"""Scale from zero, the picker's side: a request that finds no ready endpoint waits here (its
ext_proc stream open, so Envoy holds the client) until one becomes ready, the wait's time runs
out, or the queue is full. Demand is visible while requests wait: the pending count (a metric)
and a callback, so whatever scales the replicas can start one."""
from __future__ import annotations

import logging
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable

from kvship.router.pool import Pool

logger = logging.getLogger("kvship.router")


class Holding:
    def __init__(self, pool: Pool, timeout_s: float = 0.0, max_pending: int = 256,
                 on_demand: Callable[[int], None] | None = None):
        self.pool = pool
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.on_demand = on_demand  # called with the pending count when the first request starts waiting
        self.pending = 0

    def wait(self) -> str:
        """'ready' once an endpoint is healthy; else 'off' (holding disabled), 'full' or 'timeout'."""
        with self.pool.lock:
            if self.pool.healthy():
                return "ready"
            if self.timeout_s <= 0:
                return "off"
            if self.pending >= self.max_pending:
                return "full"
            self.pending += 1
            first = self.pending == 1
        if first and self.on_demand is not None:
            try:
                self.on_demand(1)
            except Exception:  # noqa: BLE001 - a failing hook must not lose the request
                logger.exception("the demand hook failed")
        start = time.monotonic()
        with self.pool.lock:
            try:
                ready = self.pool.became_ready.wait_for(lambda: bool(self.pool.healthy()), self.timeout_s)
            finally:
                self.pending -= 1
        logger.info("held a request %.2fs: %s", time.monotonic() - start, "released" if ready else "timed out")
        return "ready" if ready else "timeout"


def demand_command(command: str) -> Callable[[int], None]:
    """A demand hook that runs `command` in the background (at most one at a time)."""
    argv = shlex.split(command)
    running = threading.Lock()

    def run(pending: int) -> None:
        if not running.acquire(blocking=False):
            return
        try:
            subprocess.run(argv, env={**os.environ, "KVSHIP_ROUTER_PENDING": str(pending)}, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("demand command %r failed: %s", command, exc)
        finally:
            running.release()

    return lambda pending: threading.Thread(target=run, args=(pending,), daemon=True,
                                            name="kvship-router-demand").start()
