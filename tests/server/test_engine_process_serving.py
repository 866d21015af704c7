"""`kvship serve --engine-process` (SmolLM2 on CPU, a real server on loopback, the official openai
client): answers, streamed and whole, as the engine in a thread gives them; the engine's queue in
/metrics; SIGTERM stops both processes; an engine process that dies takes the server down with
exit code 1, so that it is restarted."""
from __future__ import annotations

import os
import signal

import openai
import pytest

from procs import live_children
from server_utils import FLOAT32_WEIGHTS, start_server

pytestmark = pytest.mark.timeout(600)

ARGS = ("--max-model-len", "512", "--kv-cache-memory", "256MiB", "--shutdown-timeout", "3", *FLOAT32_WEIGHTS)
QUESTION = [{"role": "user", "content": "Name three colours."}]


def engine_child(server_pid: int) -> int:
    """The server's engine process (multiprocessing's resource tracker is a child too)."""
    (pid,) = [p for p in live_children(server_pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    return pid


def answers(url: str) -> tuple[str, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60)
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    assert whole.usage.completion_tokens == 20 or whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return whole.choices[0].message.content, streamed


def test_answers_as_the_thread_engine_and_stops_with_its_server():
    apart = start_server("--engine-process", *ARGS)
    try:
        engine_pid = engine_child(apart.proc.pid)
        whole, streamed = answers(apart.url)
        assert whole and streamed == whole
        client = openai.OpenAI(base_url=apart.url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(model=client.models.list().data[0].id, prompt="word " * 600, max_tokens=4)
        m = apart.metrics()
        assert m["kvship:num_requests_running"] == 0 and m["kvship:generation_tokens_total"] >= 40
    finally:
        code = apart.stop()
    assert code == 0, apart.log()
    assert not os.path.exists(f"/proc/{engine_pid}") or open(f"/proc/{engine_pid}/stat").read().split()[2] == "Z"
    together = start_server(*ARGS)
    try:
        assert answers(together.url) == (whole, streamed)
    finally:
        together.stop()


def test_a_dead_engine_process_ends_the_server():
    srv = start_server("--engine-process", *ARGS)
    try:
        engine_pid = engine_child(srv.proc.pid)
        os.kill(engine_pid, signal.SIGKILL)
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert code == 1, srv.log()
    assert "engine" in srv.log()
