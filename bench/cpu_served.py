"""cpu_latency.py's served rows: the bundled model through a real `kvship serve` on loopback.

served_decode: one streamed completion, its decode tok/s (first to last token) and TTFT.
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

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, popen_logged, wait_ready


class Served:
    """`kvship serve` (the bundled model, CPU, no prefix cache: every request prefills) for a `with` block."""

    def __init__(self, max_model_len: int, threads: int | None):
        self.base = f"http://127.0.0.1:{free_port()}"
        extra = ["--cpu-threads", str(threads)] if threads else []
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
    body = {"prompt": ids, "max_tokens": out, "ignore_eos": True, "temperature": 0, "stream": True}
    t0, times = time.perf_counter(), []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                times.append(time.perf_counter())
    return t0, times


def served_decode(base: str, ids: list[int], out: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one streamed request, after a warm-up one."""
    stream_completion(base, ids, 4)
    t0, times = stream_completion(base, ids, 1 + out)
    assert len(times) == 1 + out, len(times)
    return times[0] - t0, out / (times[-1] - times[0])


def running(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvship:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvship:num_requests_running in /metrics")


def chat_during_prefill(base: str, long_ids: list[int], max_tokens: int = 8) -> tuple[float, float, bool]:
    """(short chat's answer s, the long prompt's TTFT s, whether the chat was answered first):
    the chat is sent once the long prompt is running (its prefill under way)."""
    long_result: list = []
    t = threading.Thread(target=lambda: long_result.append(stream_completion(base, long_ids, 1)))
    t.start()
    while running(base) < 1:
        time.sleep(0.02)
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens, "temperature": 0})
    answered = time.perf_counter()
    r.raise_for_status()
    t.join()
    sent, times = long_result[0]
    return answered - t0, times[0] - sent, answered < times[0]
