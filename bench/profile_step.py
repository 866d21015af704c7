"""Where a decode step's GPU time goes, kernel by kernel: the engine decodes a batch of
random-token requests (random weights of a real shape) under torch.profiler, and the table sums
each kernel's device time per decode step, largest first, with its share of the step. Eager
mode by default so that every kernel is attributed (the CUDA-graph replay runs the same kernels
with less launch overhead); --graphs profiles the graph replays instead.

    python bench/profile_step.py [--shape llama3-8b] [--batch 1] [--context 512] [--steps 32] [--graphs] [--tp 1]
                                 [--quantization fp8|int8|int4|int4-g32] [--kv-cache-dtype fp8|int4]

With --tp N the profile is rank 0's (its share of the weights plus the all-reduces).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, WEIGHT_FORMATS, header, insitu_method, kernel_rows, table, write_shape_folder
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--quantization", choices=WEIGHT_FORMATS, help="in-situ weight format")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4"])
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    method = insitu_method(args.quantization)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        llm = LLM(folder, load_format="dummy", dtype="bfloat16" if cuda else "float32",
                  max_model_len=args.context + 2 * args.steps + 64, max_num_seqs=max(8, args.batch),
                  enforce_eager=not args.graphs, tensor_parallel_size=args.tp,
                  quantization=method, kv_cache_dtype=args.kv_cache_dtype)
        eng = llm.engine
        vocab = eng.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 16, ignore_eos=True)
        llm.generate([torch.randint(2, vocab, (32,), generator=g).tolist()], SamplingParams(max_tokens=4))  # warm-up
        for i in range(args.batch):
            eng.add_request(f"p{i}", torch.randint(2, vocab, (args.context,), generator=g).tolist(), params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()  # prefill, not profiled
        for _ in range(4):
            eng.step()  # settle into pure decode
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                eng.step()
            if cuda:
                torch.cuda.synchronize()
        eng.shutdown()
    rows = kernel_rows(prof, args.steps, args.top, cuda)  # µs per step
    print(header(f"Decode step profile, {args.shape} shape, batch {args.batch}, context {args.context}, "
                 f"{'CUDA graphs' if args.graphs else 'eager'}, TP={args.tp}, weights {args.quantization or 'bf16'}, "
                 f"{args.kv_cache_dtype} KV"))
    print(table(rows, ["kernel", "µs / step", "launches / step", "share"]))


if __name__ == "__main__":
    main()
