"""Perplexity of the bundled SmolLM2-135M with each KV-cache dtype as the engine runs it, on any
device: on a GPU that is the Triton path (the fused rotary + quantizing store, the prefill
kernel reading the quantized pages) in the model's dtype, which the CPU tests
(tests/engine/test_kv_quant_engine.py, float32, torch reference) do not exercise. Same six windows of
license text as that test (transformers' Apache-2.0 text, two windows of 1,024 tokens; numpy's
LICENSE.txt, four).

    python3 bench/kv_perplexity.py                        # cuda when there is one, bfloat16
    python3 bench/kv_perplexity.py --device cpu --dtype float32
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time

import torch

from common import header, table
from kv_quality import TEXTS, WINDOW
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8", "int4"])
    args = ap.parse_args()
    rows, base = [], None
    for kv in args.kv_cache_dtypes:
        t0 = time.monotonic()
        # prompt logprobs are prefill alone: no CUDA graphs to capture
        llm = LLM(device=args.device, dtype=args.dtype, kv_cache_dtype=kv, num_kv_blocks=160, enforce_eager=True)
        tok = llm.engine.tokenizer
        windows = []
        for dist, path, which in TEXTS:
            ids = tok.encode(importlib.metadata.distribution(dist).read_text(path))
            windows += [ids[i * WINDOW:(i + 1) * WINDOW] for i in which]
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        per = []
        for ids in windows:
            out = llm.generate([ids], params)[0]
            per.append(-sum(c.logprob for c, _ in out.prompt_logprobs) / (len(ids) - 1))
        base = base or per
        ppl, ref = math.exp(sum(per) / len(per)), math.exp(sum(base) / len(base))
        by_window = " ".join(f"{100 * (math.exp(a - b) - 1):+.1f}%" for a, b in zip(per, base))
        rows.append([kv, f"{ppl:.4f}", f"{100 * (ppl / ref - 1):+.2f}%", by_window])
        print(f"{kv}: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        del llm
    print(header(f"SmolLM2-135M perplexity by KV-cache dtype: {len(base)} windows of {WINDOW} tokens, "
                 f"{args.device}, {args.dtype}"))
    print(table(rows, ["KV cache", "perplexity", f"vs {args.kv_cache_dtypes[0]}", "windows"]))


if __name__ == "__main__":
    main()
