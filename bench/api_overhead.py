"""API overhead on the CPU: requests/s of max_tokens=1 chat completions through `kvship serve`
(HTTP, JSON, chat template, tokenising, the engine thread hand-off, the response) against the
engine's own rate for the same requests added to it directly, in the same run. The model is a
tiny one with random weights, so the forward pass costs almost nothing and what is left is the
request path: a slow one shows up as a ratio far below 1. --max-tokens N: answers of N tokens
(sent whole), so that the per-step work of many running requests shows; with --stream, sent
token by token (server-sent events), the engine alone then building every step's outputs.

    python bench/api_overhead.py [--requests 400] [--concurrency 1 8 32] [--max-tokens 1] [--stream] [--server-arg=...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h11
import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_shape_folder
from kvship.llm import LLM
from kvship.ports import free_port
from kvship.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": " ".join(f"w{i}" for i in range(2, 34))}]  # 32 words: 32 tokens


def tiny_chat_model(root: str) -> str:
    folder = write_shape_folder("tiny", root)
    cfg_path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    cfg_path.write_text(json.dumps(cfg))
    return folder


def engine_rate(folder: str, n: int, concurrency: int, max_tokens: int, stream: bool = False) -> float:
    """Requests/s of the engine alone: `concurrency` requests in flight, added and stepped
    directly (what the server's requests cost the engine, without the server)."""
    llm = LLM(folder, load_format="dummy", device="cpu", max_num_seqs=max(concurrency, 1), max_model_len=256)
    eng = llm.engine
    ids = eng.tokenizer.encode(MESSAGES[0]["content"] + " ", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(count: int, tag: str) -> float:
        added = done = 0
        t0 = time.perf_counter()
        while done < count:
            while added < count and added - done < concurrency:
                eng.add_request(f"{tag}{added}", ids, params, final_only=not stream)  # as the server asks
                added += 1
            done += sum(1 for out in eng.step() if out.finished)
        return count / (time.perf_counter() - t0)

    run(max(8, concurrency), "warm")  # first steps allocate and warm caches, as the server's warm-up does
    return run(n, "r")


async def post_loop(port: int, body: bytes, state: dict, latencies: list[float]) -> None:
    """One keep-alive connection posting ``body`` while requests are left. h11 frames the HTTP
    (as in uvicorn): a light client, so that what is measured is the server; httpx's pool cost
    more CPU than the server at 64 connections on a 2-core machine."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", str(len(body)))]
    try:
        while state["left"] > 0:
            state["left"] -= 1
            t0 = time.perf_counter()
            writer.write(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
                         + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status = 0
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(1 << 16))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.ConnectionClosed):
                    raise RuntimeError("the server closed the connection")
            if status != 200:
                raise RuntimeError(f"the server answered {status}")
            latencies.append(time.perf_counter() - t0)
            conn.start_next_cycle()
    finally:
        writer.close()


async def api_rate(port: int, n: int, concurrency: int, max_tokens: int, stream: bool = False) -> tuple[float, float]:
    """(requests/s, median latency in seconds) of ``concurrency`` connections posting ``n`` chats."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()
    latencies: list[float] = []
    await asyncio.gather(*(post_loop(port, body, {"left": 8}, latencies) for _ in range(4)))  # warm-up
    latencies.clear()
    state = {"left": n}
    t0 = time.perf_counter()
    await asyncio.gather(*(post_loop(port, body, state, latencies) for _ in range(concurrency)))
    return n / (time.perf_counter() - t0), sorted(latencies)[len(latencies) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--stream", action="store_true", help="answers streamed token by token")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `kvship serve` argument (repeatable), e.g. --server-arg=--engine-process")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_chat_model(tmp)
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "kvship.cli", "serve", folder, "--load-format", "dummy", "--device", "cpu",
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--no-chat-page",
             "--max-num-seqs", str(max(args.concurrency)), "--log-level", "warning", *args.server_arg],
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start")
                time.sleep(0.5)
            rows = []
            for c in args.concurrency:
                api, p50 = asyncio.run(api_rate(port, args.requests, c, args.max_tokens, args.stream))
                direct = engine_rate(folder, args.requests, c, args.max_tokens, args.stream)
                rows.append([c, f"{api:.0f}", f"{p50 * 1e3:.1f}", f"{direct:.0f}", f"{api / direct:.2f}"])
        finally:
            server.terminate()
            server.wait(30)
    print(f"max_tokens={args.max_tokens} chat completions{', streamed' if args.stream else ''}, tiny random model on CPU, {args.requests} requests per row"
          f"{', server: ' + ' '.join(args.server_arg) if args.server_arg else ''}\n")
    print(table(rows, ["concurrency", "API requests/s", "API latency p50 ms", "engine alone requests/s", "API / engine"]))


if __name__ == "__main__":
    main()
