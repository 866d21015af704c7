"""Time to first token of bursts of 1024-token prompts (random weights, Llama-3-8B shape):
straight into the engine with each step's wall time (engine), and through `kvship serve` over
HTTP with the server's log (http). Shows what a burst costs and catches stalls such as kernel
recompilation in the middle of serving.

    python bench/diag_burst.py [engine|http|both|joins|async-joins]

joins: one prompt joining c - 1 decoding sequences, step by step (steady-state serving TTFT).
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_shape_folder
from kvship.config import EngineConfig
from kvship.core.engine import LLMEngine
from kvship.sampling_params import SamplingParams
from serve import free_port, run_level, server_log_tail, start_server, wait_ready

PROMPT, OUTPUT = 1024, 16


def engine_bursts(folder: str) -> None:
    eng = LLMEngine(EngineConfig(model=folder, load_format="dummy", max_model_len=PROMPT + 272))
    k = 0
    for n in (1, 8, 8, 32):
        t0 = time.perf_counter()
        for _ in range(n):
            k += 1
            eng.add_request(f"r{k}", torch.randint(2, 128000, (PROMPT,)).tolist(),
                            SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True))
        first, steps = {}, []
        while eng.has_work():
            ts = time.perf_counter()
            outs = eng.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            te = time.perf_counter()
            steps.append(round((te - ts) * 1e3, 1))
            for o in outs:
                if o.outputs[0].token_ids and o.request_id not in first:
                    first[o.request_id] = te - t0
        print(f"engine burst {n}: TTFT ms {sorted(round(v * 1e3) for v in first.values())}; "
              f"first steps ms {steps[:8]}", flush=True)


def engine_joins(folder: str) -> None:
    """Steady state: c - 1 sequences decoding, then one 1024-token prompt joins; each step's wall
    time until the newcomer's first token (what serving TTFT is made of, without HTTP)."""
    eng = LLMEngine(EngineConfig(model=folder, load_format="dummy", max_model_len=PROMPT + 600))
    for c in (1, 8, 32):
        for i in range(c - 1):
            eng.add_request(f"bg{c}-{i}", torch.randint(2, 128000, (PROMPT,)).tolist(),
                            SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        for _ in range(20):
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        eng.add_request(f"new{c}", torch.randint(2, 128000, (PROMPT,)).tolist(),
                        SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True))
        t0, steps = time.perf_counter(), []
        while True:
            ts = time.perf_counter()
            outs = eng.step()
            steps.append(round((time.perf_counter() - ts) * 1e3, 1))
            if any(o.request_id == f"new{c}" and o.outputs[0].token_ids for o in outs):
                break
        print(f"engine join at c={c}: first token after {(time.perf_counter() - t0) * 1e3:.0f} ms, "
              f"steps ms {steps}", flush=True)
        for i in range(c - 1):
            eng.abort(f"bg{c}-{i}")
        while eng.has_work():
            eng.step()


def async_joins(folder: str) -> None:
    """As engine_joins, through AsyncEngine (engine thread + asyncio consumers, no HTTP): tells
    whether a slow join in serving comes from the thread hand-off or from the HTTP layer."""
    from kvship.core.async_engine import AsyncEngine

    eng = AsyncEngine(LLMEngine(EngineConfig(model=folder, load_format="dummy", max_model_len=PROMPT + 600)))
    vocab = eng.engine.model_config.vocab_size

    async def consume(rid: str, max_tokens: int, t0: float) -> float:
        first = None
        async for out in eng.generate(torch.randint(2, vocab, (PROMPT,)).tolist(),
                                      SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), rid):
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
        return first

    async def run(c: int) -> None:
        bg = [asyncio.create_task(consume(f"bg{c}-{i}", 400, time.perf_counter())) for i in range(c - 1)]
        await asyncio.sleep(0.5)
        ttfts = []
        for j in range(3):
            ttfts.append(await consume(f"new{c}-{j}", 2, time.perf_counter()))
            await asyncio.sleep(0.1)
        print(f"async join at c={c}: TTFT ms {[round(t * 1e3) for t in ttfts]}", flush=True)
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        await asyncio.sleep(0.5)

    for c in (1, 8, 32):
        asyncio.run(run(c))
    eng.shutdown()


def http_bursts(folder: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(folder, port, ["--load-format", "dummy", "--max-model-len", str(PROMPT + 272),
                                       "--log-level", "debug"])
    try:
        wait_ready(proc, base)
        for n in (1, 8, 8):
            res, _ = asyncio.run(run_level(base, n, n, PROMPT, OUTPUT, 128000, seed=n))
            print(f"http burst {n}: TTFT ms {sorted(round(r[0] * 1e3) for r in res)}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        print(server_log_tail(proc)[-1500:])


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "both"
    folder = write_shape_folder("llama3-8b", tempfile.mkdtemp())
    if mode in ("both", "engine"):
        engine_bursts(folder)
        torch.cuda.empty_cache()
    if mode == "joins":
        engine_joins(folder)
    if mode == "async-joins":
        async_joins(folder)
    if mode in ("both", "http"):
        http_bursts(folder)


if __name__ == "__main__":
    main()
