"""Start the real `kvship serve` as a subprocess on a free loopback port, for the server tests."""
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

LOAD_TIMEOUT_S = float(os.environ.get("KVSHIP_TEST_LOAD_TIMEOUT", "240"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kvship.cli serve --host 127.0.0.1 --port P ARGS...`; output goes to a log file
    (shown when something goes wrong)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "kvship.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = tempfile.NamedTemporaryFile(prefix="kvship-server-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        full_env = dict(os.environ)
        full_env.pop("KVSHIP_API_KEY", None)  # keys only where a test passes one
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout:.0f}s:\n{self.log()}")

    def send_signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """/metrics as {name: value} (labels dropped; one series per name here)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            out[name_labels.split("{", 1)[0]] = float(value)
        return out

    def wait_metric(self, name: str, predicate, timeout: float = 15) -> float:
        deadline = time.monotonic() + timeout
        value = self.metrics()[name]
        while not predicate(value):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value} for {timeout}s")
            time.sleep(0.1)
            value = self.metrics()[name]
        return value


def start_server(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
    # free_port() only finds a port that was free: a process of the other test worker may take it
    # before the server binds, so a server that lost that race starts again on another one.
    for attempt in range(1, 4):
        server = ServerProcess(*args, env=env)
        try:
            server.wait_ready()
            return server
        except BaseException as e:
            server.stop(5)
            lost_the_port = isinstance(e, RuntimeError) and "address already in use" in server.log()
            if not lost_the_port or attempt == 3:
                raise


def assert_error(resp: httpx.Response, status: int, param: str | None = "ANY") -> dict:
    """An OpenAI-shaped error with this status (and `param`, unless "ANY"); its `error` object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != "ANY":
        assert err["param"] == param, err
    return err
