"""Time to first token of bursts of 1024-token prompts (random weights, Llama-3-8B shape):
straight into the engine with each step's wall time (engine), and through `kvship serve` over
HTTP with the server's log (http). Shows what a burst costs and catches stalls such as kernel
recompilation in the middle of serving.

    python bench/diag_burst.py [engine|http|both]
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_shape_folder  # noqa: E402
from serve import free_port, run_level, server_log_tail, start_server, wait_ready  # noqa: E402

from kvship.config import EngineConfig  # noqa: E402
from kvship.core.engine import LLMEngine  # noqa: E402
from kvship.sampling_params import SamplingParams  # noqa: E402

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
    if mode in ("both", "http"):
        http_bursts(folder)


if __name__ == "__main__":
    main()
