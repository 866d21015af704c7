"""KV-bound decode: batch 32, 8k-token contexts (8B shape: ~34 GB of bf16 KV read per step
against 16 GB of weights), for each --kv-cache-dtype, with the step's byte limit beside it and
how many 8k-token sequences the cache holds (from its block count).

Prompts are prefilled once; the timed runs hit the prefix cache, so the difference between a
1-token and a (1 + N)-token run is N decode steps. Each dtype runs in a process of its own: in one
process a later engine found less free memory than the first (the earlier one's not all given
back), which shrank its block count (2026-12-02 runs: fp8 1.7x and int4 2.7x the bf16 sequences,
where their bytes per block are exactly 2.0x and 3.2x smaller).

    python bench/kv_decode.py [--shape llama3-8b] [--batch 32] [--context 8000] [--kv auto fp8 int4]
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    SHAPES,
    header,
    kv_bytes_per_token,
    measure_ceilings,
    param_count,
    table,
    write_shape_folder,
)
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams


def run(folder, kv: str, prompts, new_tokens: int) -> tuple[float, int]:
    """(decode tok/s, 8k sequences the cache holds)."""
    ctx = len(prompts[0])
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=ctx + new_tokens + 16,
              max_num_seqs=len(prompts), max_num_batched_tokens=8192, kv_cache_dtype=kv)

    def timed(n: int, llm=llm) -> float:
        torch.cuda.synchronize()
        t0 = time.monotonic()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.monotonic() - t0

    timed(2)  # prefill (cached from now on), warm-up
    hit = min(timed(1) for _ in range(2))
    full = timed(1 + new_tokens)
    kv_mgr = llm.engine.kv
    fits = kv_mgr.num_blocks * llm.engine.config.block_size // (ctx + new_tokens)
    del llm
    torch.cuda.empty_cache()
    return len(prompts) * new_tokens / (full - hit), fits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8000)  # + new tokens within the 8B shape's 8192 positions
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--kv", nargs="+", default=["auto", "fp8", "int4"], help="KV-cache dtypes")
    args = ap.parse_args()
    bw, _ = measure_ceilings()
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [torch.randint(2, vocab, (args.context,), generator=g).tolist() for _ in range(args.batch)]
    avg_ctx = args.context + args.new_tokens / 2
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        for kv in args.kv:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
                rate, fits = child.submit(run, folder, kv, prompts, args.new_tokens).result()
            step_bytes = param_count(args.shape) * 2 + args.batch * avg_ctx * kv_bytes_per_token(
                args.shape, kv_cache_dtype=kv)
            limit = args.batch * bw / step_bytes
            base = base or (rate, fits)
            rows.append([kv, f"{rate:,.0f}", f"{rate / base[0]:.2f}x", f"{limit:,.0f}", f"{100 * rate / limit:.0f}%",
                         f"{fits:,} ({fits / base[1]:.1f}x)"])
            print(f"{kv} done", file=sys.stderr, flush=True)
    print(header(f"KV-bound decode, {args.shape} shape, bf16 weights, batch {args.batch}, "
                 f"{args.context}-token contexts, {args.new_tokens} new tokens"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print(table(rows, ["KV cache", "decode tok/s", f"vs {args.kv[0]}", "byte limit tok/s", "of limit",
                       f"{args.context + args.new_tokens}-token sequences that fit"]))


if __name__ == "__main__":
    main()
