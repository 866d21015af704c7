"""The bundled model served on the CPU: a short chat sent while a 2,000-token prompt prefills is
answered at once, beside the prefill's chunks, not after them (the step budget is shared)."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from server_utils import start_server

# The target is 1 s to the chat's first token; a loaded CI machine (several test workers on two
# cores) runs a step several times slower, hence the margin. That the chat is answered before
# the long prompt's first token is the part that does not depend on the machine.
CHAT_FIRST_TOKEN_S = 1.0
LOADED_MACHINE_MARGIN = 4


def _stream(url: str, path: str, body: dict) -> tuple[float, list[float]]:
    """(send time, arrival of each streamed chunk that carries a token)."""
    t0, times = time.perf_counter(), []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                times.append(time.perf_counter())
    return t0, times


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvship:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kvship:num_requests_running in /metrics")


@pytest.mark.timeout(400)
def test_short_chat_answered_during_long_prefill():
    server = start_server("--device", "cpu", "--max-model-len", "2200", "--no-enable-prefix-caching",
                          "--cpu-weight-format", "int8")
    try:
        long_prompt = [100 + (i * 7919) % 40000 for i in range(2000)]
        long_result: list = []
        t = threading.Thread(target=lambda: long_result.append(
            _stream(server.url, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1, "temperature": 0})))
        t.start()
        deadline = time.monotonic() + 60
        while _running(server.url) < 1:  # the long prompt's prefill is under way
            assert time.monotonic() < deadline and t.is_alive(), server.log()
            time.sleep(0.02)
        sent, chat = _stream(server.url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0})
        t.join(300)
        long_sent, long_times = long_result[0]
        assert chat and long_times, (chat, long_times)
        chat_first = chat[0] - sent
        assert chat[-1] < long_times[0], ("the chat waited for the prefill", chat[-1] - sent, long_times[0] - long_sent)
        assert chat_first < CHAT_FIRST_TOKEN_S * LOADED_MACHINE_MARGIN, (chat_first, long_times[0] - long_sent)
        # the start-up line names the threads chosen, the compute dtype and the weights' formats
        assert re.search(r"CPU: threads \d+ of \d+ \(a decode step took .*\); compute float32; weights .*int8 \d+ MB",
                         server.log()), server.log()
    finally:
        server.stop()
