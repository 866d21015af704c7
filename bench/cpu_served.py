"""cpu_latency.py's served rows: the bundled model through a real `kvship serve` on loopback.

served_decode: one streamed completion, its decode tok/s (first to last token), TTFT and the
server's CPU time a token.
chat_during_prefill: a long prompt's prefill under way, a short chat's whole answer time, and
whether it came before the long prompt's first token (the step budget shared, not queued behind).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, popen_logged, wait_ready


class Served:
    """`kvship serve` (the bundled model, CPU, no prefix cache: every request prefills) for a `with` block."""

    def __init__(self, max_model_len: int, threads: int | None, weight_format: str):
        self.base = f"http://127.0.0.1:{free_port()}"
        extra = ["--cpu-weight-format", weight_format] + (["--cpu-threads", str(threads)] if threads else [])
        self.proc = popen_logged([sys.executable, "-m", "kvship.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                                  "--port", self.base.rsplit(":", 1)[1], "--no-enable-prefix-caching",
                                  "--max-model-len", str(max_model_len), *extra])

    def __enter__(self) -> "Served":
        wait_ready(self.proc, self.base)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)

    def log(self) -> str:
        self.proc.log.seek(0)
        return self.proc.log.read()


def stream_completion(base: str, ids: list[int], out: int) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed token) of one greedy completion."""
    return stream(base, "/v1/completions", {"prompt": ids, "max_tokens": out, "ignore_eos": True})


def stream(base: str, path: str, body: dict) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed chunk that carries text), greedy."""
    t0, times = time.perf_counter(), []
    with httpx.stream("POST", base + path, json={**body, "temperature": 0, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                times.append(time.perf_counter())
    return t0, times


def served_decode(server: Served, ids: list[int], out: int) -> tuple[float, float, float]:
    """(TTFT s, decode tok/s, the server's CPU ms a decoded token) of one streamed request, after
    a warm-up one; CPU time as cpu_latency.time_kvship counts it (a run of 1 + out tokens less
    one of 1)."""
    proc = psutil.Process(server.proc.pid)

    def run(n: int) -> tuple[float, list[float], float]:
        before = sum(proc.cpu_times()[:2])
        sent, times = stream_completion(server.base, ids, n)
        assert len(times) == n, len(times)
        return sent, times, sum(proc.cpu_times()[:2]) - before

    run(4)
    _, _, first_cpu = run(1)
    sent, times, whole_cpu = run(1 + out)
    return times[0] - sent, out / (times[-1] - times[0]), (whole_cpu - first_cpu) / out * 1e3


def running(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvship:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvship:num_requests_running in /metrics")


def chat_during_prefill(base: str, long_ids: list[int], max_tokens: int = 8) -> tuple[float, float, float, bool]:
    """(short chat's first token s, its whole answer s, the long prompt's TTFT s, whether the chat
    was answered first): the chat is sent once the long prompt is running (its prefill under way)."""
    long_result: list = []
    t = threading.Thread(target=lambda: long_result.append(stream_completion(base, long_ids, 1)))
    t.start()
    while running(base) < 1:
        time.sleep(0.02)
    sent, chat = stream(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                       "max_tokens": max_tokens})
    t.join()
    long_sent, long_times = long_result[0]
    return chat[0] - sent, chat[-1] - sent, long_times[0] - long_sent, chat[-1] < long_times[0]
