"""`kvship router` as a real process on free loopback ports, for the tests that run it beside
real engines."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server_utils import free_port


class RouterProcess:
    """`python -m kvship.cli router` on free ports; its log is shown when something goes wrong."""

    def __init__(self, endpoints: list[str], policy: str, *extra: str, env: dict[str, str] | None = None):
        self.port, self.picker_port, self.metrics_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="kvship-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvship.cli", "router", "--host", "127.0.0.1", "--port", str(self.port),
             "--picker-port", str(self.picker_port), "--metrics-port", str(self.metrics_port),
             "--policy", policy, *(extra or ("--scrape-interval", "0.2")),
             *(a for e in endpoints for a in ("--endpoint", e))],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"router not ready after {timeout}s:\n{self.log()}")

    def wait_started(self, timeout: float = 60) -> None:
        """The picker answers on its metrics port and Envoy listens (whether or not a replica is
        ready: a request now may be held)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}:\n{self.log()}"
            try:
                self.picker_metrics()
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except (httpx.HTTPError, OSError):
                time.sleep(0.2)
        raise AssertionError(f"router not started after {timeout}s:\n{self.log()}")

    def metric(self, name: str, endpoint: str | None = None, **labels: str) -> float | None:
        """One sample of the picker's /metrics (the one whose labels are `endpoint` and `labels`,
        if given), or None."""
        if endpoint is not None:
            labels = {"endpoint": endpoint, **labels}
        for line in self.picker_metrics().splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            got, _, rest = series.partition("{")
            found = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p) if rest else {}
            if got == name and {k: v.strip('"') for k, v in found.items()} == labels:
                return float(value)
        return None

    def picker_metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
