"""Start the real `kvship serve` as a subprocess on a free loopback port, for the server tests,
and time its streamed answers (bench/cpu_served.py measures with the same functions)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvship.ports import free_port

# For servers whose tests compare greedy outputs across requests: on the integer weight paths a
# prefix hit's or a batch's rows may take another kernel than the reference's, and greedy
# continuations part at a near-tie (docs/quantization.md); the float32 weights keep them exact.
FLOAT32_WEIGHTS = ("--cpu-weight-format", "float32")
LOAD_TIMEOUT_S = float(os.environ.get("KVSHIP_TEST_LOAD_TIMEOUT", "240"))


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
        return metrics(self.url)

    def wait_metric(self, name: str, predicate, timeout: float = 15) -> float:
        deadline = time.monotonic() + timeout
        value = self.metrics()[name]
        while not predicate(value):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value} for {timeout}s")
            time.sleep(0.1)
            value = self.metrics()[name]
        return value


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value} (labels dropped; one series per name here)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        out[name_labels.split("{", 1)[0]] = float(value)
    return out


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


def stream(url: str, path: str, body: dict) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed chunk that carries text), greedy."""
    t0, times = time.perf_counter(), []
    with httpx.stream("POST", url + path, json={**body, "temperature": 0, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                times.append(time.perf_counter())
    return t0, times


def stream_completion(url: str, ids: list[int], out: int) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed token) of one greedy completion."""
    return stream(url, "/v1/completions", {"prompt": ids, "max_tokens": out, "ignore_eos": True})


def chat_during_prefill(url: str, long_ids: list[int], max_tokens: int = 8) -> tuple[float, float, float, bool]:
    """(short chat's first token s, its whole answer s, the long prompt's TTFT s, whether the chat
    was answered first): the chat is sent once the long prompt is running (its prefill under way)."""
    long_result: list = []
    t = threading.Thread(target=lambda: long_result.append(stream_completion(url, long_ids, 1)))
    t.start()
    deadline = time.monotonic() + 60
    while metrics(url)["kvship:num_requests_running"] < 1:
        if time.monotonic() > deadline or not t.is_alive():
            raise AssertionError("the long prompt never ran on the server")
        time.sleep(0.02)
    sent, chat = stream(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                      "max_tokens": max_tokens})
    t.join()
    long_sent, long_times = long_result[0]
    return chat[0] - sent, chat[-1] - sent, long_times[0] - long_sent, chat[-1] < long_times[0]
