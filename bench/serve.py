"""Serving latency through the real HTTP server: `kvship serve` on loopback, streaming
completions at several concurrency levels (1024-token prompts, 256 output tokens by default).
Reports TTFT and TPOT p50/p99 and output tok/s, with the batch-1 decode roofline of the shape
(bytes per token / measured copy bandwidth) as the floor for TPOT. A level's first requests
start spread over one request's duration (steady state); --burst starts them all at once.

    python bench/serve.py [--shape llama3-8b] [--concurrency 1 8 32 64] [--requests-per-level N] [--burst]

A model shape (random weights) is served unless --model points at a real model.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, kv_bytes_per_token, param_count, pct, table, write_shape_folder
from kvship.ports import free_port


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvship.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "bench", *extra]
    return popen_logged(cmd)


def popen_logged(cmd: list[str]) -> subprocess.Popen:
    """stderr to a file, not a pipe: a pipe nobody reads would block the server once full."""
    log = tempfile.NamedTemporaryFile("w+")  # named: read from its own offset (server_compiles)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    return proc


def server_log_tail(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read()[-2000:]


COMPILE_LOG = re.compile(r"Triton kernel (\S+) compiled in ([\d,]+) ms")


def server_compiles(proc: subprocess.Popen, start: int) -> tuple[list[tuple[str, int]], int]:
    """The Triton compiles the server logged from byte ``start`` of its log on (each a step that
    waited): [(kernel, ms)], and where the log ends now."""
    with open(proc.log.name) as f:
        f.seek(start)
        text = f.read()
        end = f.tell()
    return [(name, int(ms.replace(",", ""))) for name, ms in COMPILE_LOG.findall(text)], end


def wait_ready(proc: subprocess.Popen, base: str, timeout: float = 600) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {server_log_tail(proc)}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError("server did not become ready")


async def one_request(client: httpx.AsyncClient, prompt_ids: list[int], out_len: int) -> tuple[float, float, int]:
    body = {"model": "bench", "prompt": prompt_ids, "max_tokens": out_len, "ignore_eos": True,
            "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = last = None
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"]:
                last = time.monotonic()
                first = first or last
                chunks += 1
    ttft = first - t0
    tpot = (last - first) / max(1, out_len - 1)
    return ttft, tpot, out_len


async def run_level(base: str, concurrency: int, n: int, prompt_len: int, out_len: int, vocab: int, seed: int,
                    ramp_s: float = 0.0):
    """n requests, at most `concurrency` in flight. The first `concurrency` start spread evenly
    over ramp_s seconds (0: all at once), so that with equal request lengths the arrivals stay
    spread out instead of coming in synchronized waves."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(n)]
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def go(i, p):
            async with sem:  # taken first: later requests must not slip in while the first ones wait
                if i < concurrency and ramp_s:
                    await asyncio.sleep(ramp_s * i / concurrency)
                return await one_request(c, p, out_len)

        t0 = time.monotonic()
        results = await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts)))
        wall = time.monotonic() - t0
    return results, wall


SERVER_TIMES = {"ttft": "time_to_first_token", "queue": "request_queue_time", "prefill": "request_prefill_time"}


def server_sums(base: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of the server's own TTFT, queue and prefill histograms (/metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for key, name in SERVER_TIMES.items():
        vals = {}
        for line in text.splitlines():
            for part in ("sum", "count"):
                if line.startswith(f"kvship:{name}_seconds_{part}"):
                    vals[part] = vals.get(part, 0.0) + float(line.rsplit(" ", 1)[1])
        out[key] = (vals.get("sum", 0.0), vals.get("count", 0.0))
    return out


def server_means_ms(before: dict, after: dict) -> list[str]:
    """Mean of each server-side time over the requests finished between two scrapes, in ms."""
    cells = []
    for key in SERVER_TIMES:
        n = after[key][1] - before[key][1]
        cells.append(f"{(after[key][0] - before[key][0]) / n * 1e3:.0f}" if n else "-")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="serve this model instead of a random-weight shape")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--requests-per-level", type=int, default=None,
                    help="default: max(16, 2 x concurrency), so most requests arrive into a running batch")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `kvship serve` argument (repeatable)")
    ap.add_argument("--server-log", default=None, help="copy the server's log here at the end")
    ap.add_argument("--burst", action="store_true",
                    help="start each level's first requests all at once (default: spread over one request's duration)")
    args = ap.parse_args()
    bw = None
    try:
        import torch

        if torch.cuda.is_available():
            from common import measure_ceilings

            bw, _ = measure_ceilings()
            torch.cuda.empty_cache()
    except ImportError:
        pass
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model, extra, vocab = args.model, [], 32000
        else:
            model, extra = write_shape_folder(args.shape, tmp), ["--load-format", "dummy"]
            vocab = SHAPES[args.shape]["vocab_size"]
        extra += ["--max-model-len", str(args.prompt + args.output + 16), *args.server_arg]
        proc = start_server(model, port, extra)
        try:
            ready_s = wait_ready(proc, base)
            if args.model:
                vocab = httpx.get(f"{base}/v1/models").json()["data"][0].get("vocab_size", vocab)
            asyncio.run(run_level(base, 1, 2, args.prompt, 8, vocab, seed=99))  # warm-up
            rows = []
            ramp = 0.0  # one request's duration alone, measured at the first level
            log_at = Path(proc.log.name).stat().st_size  # compiles from here on: the levels'
            for conc in args.concurrency:
                n = args.requests_per_level or max(16, 2 * conc)
                before = server_sums(base)
                res, wall = asyncio.run(run_level(base, conc, n, args.prompt, args.output, vocab, seed=conc,
                                                  ramp_s=0.0 if args.burst else ramp))
                ramp = ramp or sorted(r[0] + r[1] * (args.output - 1) for r in res)[len(res) // 2]
                ttft = [r[0] for r in res]
                tpot = [r[1] for r in res]
                compiles, log_at = server_compiles(proc, log_at)
                rows.append([conc, n, f"{pct(ttft, .5) * 1e3:.0f}", f"{pct(ttft, .99) * 1e3:.0f}",
                             f"{pct(tpot, .5) * 1e3:.1f}", f"{pct(tpot, .99) * 1e3:.1f}",
                             f"{sum(r[2] for r in res) / wall:,.0f}", *server_means_ms(before, server_sums(base)),
                             ", ".join(f"{name} {ms:,} ms" for name, ms in compiles) or "none"])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            if args.server_log:
                proc.log.seek(0)
                Path(args.server_log).write_text(proc.log.read())
    print(header(f"Serving through HTTP, {args.model or args.shape + ' shape (random weights)'}, "
                 f"prompt {args.prompt}, output {args.output}"))
    print(f"server ready after {ready_s:.1f} s (process start to /health 200); arrivals: "
          + ("each level's first requests all at once" if args.burst else
             f"each level's first requests spread over one request's duration at concurrency 1 ({ramp:.2f} s)"))
    if args.server_arg:
        print("server arguments: " + " ".join(args.server_arg))
    if bw and not args.model:
        floor = (param_count(args.shape) * 2 + (args.prompt + args.output / 2) * kv_bytes_per_token(args.shape)) / bw
        print(f"TPOT floor at batch 1 (bytes per token / copy bandwidth {bw / 1e12:.2f} TB/s): {floor * 1e3:.2f} ms")
    print()
    print("server-side means (its /metrics histograms): TTFT from arrival in the engine, queue = arrival to "
          "first scheduled, prefill = first scheduled to first token; compiles: the Triton kernels the server "
          "logged compiling during the level (a step waited for each)\n")
    print(table(rows, ["concurrency", "requests", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                       "output tok/s", "server TTFT ms", "queue ms", "prefill ms", "compiles"]))


if __name__ == "__main__":
    main()
