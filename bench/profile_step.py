"""Where a decode step's GPU time goes, kernel by kernel: the engine decodes a batch of
random-token requests (random weights of a real shape) under torch.profiler, and the table sums
each kernel's device time per decode step, largest first, with its share of the step. Eager
mode by default so that every kernel is attributed (the CUDA-graph replay runs the same kernels
with less launch overhead); --graphs profiles the graph replays instead.

    python bench/profile_step.py [--shape llama3-8b] [--batch 1] [--context 512] [--steps 32] [--graphs] [--tp 1]
                                 [--quantization fp8|int8|int4|int4-g32] [--kv-cache-dtype fp8|int4] [--join N]

With --join N each profiled step is a mixed one: a new N-token prompt joins the decodes (as in
serving, where prompts arrive while others decode), its whole prefill in that step.

With --tp N the profile is rank 0's (its share of the weights plus the all-reduces). With --host
the timed steps' wall time each, and where the host spent it (cProfile, the functions taking the
most time themselves: a kernel compiled mid-run or a wait on the device shows there).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, WEIGHT_FORMATS, header, insitu_method, kernel_rows, table, write_shape_folder
from kvship.kernels._triton import watch_compiles
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
    ap.add_argument("--join", type=int, default=0, help="a prompt of this many tokens joins each profiled step")
    ap.add_argument("--host", action="store_true", help="also each timed step's wall time and the host's profile")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4"])
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    method = insitu_method(args.quantization)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder(args.shape, tmp)
        llm = LLM(folder, load_format="dummy", dtype="bfloat16" if cuda else "float32",
                  max_model_len=max(args.context, args.join) + 4 * args.steps + 64,
                  max_num_seqs=max(8, args.batch + ((3 if args.host else 2) * args.steps + 4 if args.join else 0)),
                  enforce_eager=not args.graphs, tensor_parallel_size=args.tp,
                  quantization=method, kv_cache_dtype=args.kv_cache_dtype)
        eng = llm.engine
        vocab = eng.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 16, ignore_eos=True)
        llm.generate([torch.randint(2, vocab, (32,), generator=g).tolist()], SamplingParams(max_tokens=4))  # warm-up
        for i in range(args.batch):
            eng.add_request(f"p{i}", torch.randint(2, vocab, (args.context,), generator=g).tolist(), params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()  # prefill, not profiled
        joined = itertools.count()

        def step():
            if args.join:
                eng.add_request(f"j{next(joined)}", torch.randint(2, vocab, (args.join,), generator=g).tolist(), params)
            eng.step()

        for _ in range(4):
            step()  # settle (a first mixed step compiles its kernels)
        if cuda:
            torch.cuda.synchronize()
        compiles: list[tuple[str, float, str]] = []
        if args.host:
            watch_compiles(lambda name, seconds, new: compiles.append((name, seconds, new)))
        step_ms = []
        allocs = allocator_counts(cuda)
        t0 = time.perf_counter()
        for _ in range(args.steps):  # the same steps' wall time, without the profiler, for the gaps
            t = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t) * 1e3)
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e6
        allocs = {k: v - allocs[k] for k, v in allocator_counts(cuda).items()}
        host = cProfile.Profile() if args.host else None
        if host is not None:  # as many steps again, the host under cProfile (which slows it)
            for _ in range(args.steps):
                host.runcall(step)
            if cuda:
                torch.cuda.synchronize()
        replay = replay_time(eng, args.batch, args.steps) if args.graphs and cuda else None
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
            if cuda:
                torch.cuda.synchronize()
        eng.shutdown()
    rows = kernel_rows(prof, args.steps, args.top, cuda)  # µs per step
    print(header(f"Decode step profile, {args.shape} shape, batch {args.batch}, context {args.context}, "
                 f"{'CUDA graphs' if args.graphs else 'eager'}, TP={args.tp}, weights {args.quantization or 'bf16'}, "
                 f"{args.kv_cache_dtype} KV" + (f", a {args.join}-token prompt joining each step" if args.join else "")))
    print(table(rows, ["kernel", "µs / step", "launches / step", "share"]))
    print(f"\nwall time per step, the same decode without the profiler: {wall:,.1f} µs")
    if host is not None:
        text = io.StringIO()
        stats = pstats.Stats(host, stream=text)
        stats.sort_stats("tottime").print_stats(15)
        stats.sort_stats("cumulative").print_stats(25)
        print(f"\neach of those steps' wall time (ms): {', '.join(f'{t:.1f}' for t in step_ms)}; the caching "
              f"allocator meanwhile: {allocs['num_device_alloc']} device allocations, {allocs['num_device_free']} "
              f"frees, {allocs['num_alloc_retries']} retries (its cache freed to make room)")
        print(f"\nTriton kernels compiled (or read from the disk cache) from the first timed step on: {len(compiles)}"
              + "".join(f"\n- {sec * 1e3:,.0f} ms: `{name}` ({new or 'its first variant here, or one for another device'})"
                        for name, sec, new in compiles))
        print(f"\nthe host over {args.steps} more steps, under cProfile:\n\n```\n{text.getvalue().strip()}\n```")
    if replay is not None and not args.join:
        print(f"the step's CUDA graph replayed alone (no host work between replays): {replay:,.1f} µs")


def allocator_counts(cuda: bool) -> dict[str, int]:
    """torch's caching allocator's counts of device allocations, frees and retries so far."""
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    stats = torch.cuda.memory_stats() if cuda else {}
    return {k: stats.get(k, 0) for k in keys}


def replay_time(eng, batch: int, n: int) -> float | None:
    """µs per replay of the decode graph that serves ``batch`` sequences, back to back: the GPU's
    step without the engine's host work, so wall time minus this is what the host adds."""
    graphs = eng.runner.graphs
    if graphs is None or batch > graphs.max_bs:
        return None
    g = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


if __name__ == "__main__":
    main()
