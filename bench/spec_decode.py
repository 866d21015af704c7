"""Speculative decoding: output tok/s with and without n-gram speculation on a copy-heavy prompt
set (the bundled SmolLM2, real weights: acceptance means something), per batch size, with the
acceptance rate measured in the same run; and, with --shape on a GPU, the time of one verify
step (k + 1 query tokens a sequence) for k = 1..8 at each batch size against one decode step
and against the weight-read floor (weight bytes / measured copy bandwidth), with the speed-up
those times give at the measured acceptance.

    python bench/spec_decode.py [--k 4] [--batch 1 8 32 64] [--output 128] [--shape llama3-8b]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, param_count, table, write_shape_folder
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

# Work that repeats its context: edits of code, summaries that quote, lists that recur.
SOURCE = ("def area(width, height):\n    return width * height\n\n"
          "def perimeter(width, height):\n    return 2 * (width + height)\n")
COPY_HEAVY = [
    f"Here is some code:\n{SOURCE}\nRewrite it with type hints, keeping everything else the same:\n",
    f"Repeat the following text exactly.\n{SOURCE}\nRepeated:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "Write that sentence three more times:",
    "Monday: gym. Tuesday: swim. Wednesday: gym. Thursday: swim. Continue the pattern to Sunday:",
]


def run_set(llm: LLM, prompts: list[str], out_len: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def end_to_end(args) -> float:
    """Table 1; returns the acceptance rate at batch 1 (accepted / proposed tokens)."""
    common = dict(device=args.device, max_model_len=2048)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": args.disable_by_batch_size})
    rows, alpha = [], None
    for b in args.batch:
        prompts = [COPY_HEAVY[i % len(COPY_HEAVY)] for i in range(b)]
        run_set(plain, prompts[:1], 8), run_set(spec, prompts[:1], 8)  # warm-up
        base = run_set(plain, prompts, args.output)
        s = spec.engine.speculator.stats
        before = (s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts)
        fast = run_set(spec, prompts, args.output)
        proposed, accepted, drafts = (x - y for x, y in zip((s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts),
                                                              before))
        rate = accepted / proposed if proposed else 0.0
        alpha = rate if alpha is None else alpha
        rows.append([b, f"{base:.1f}", f"{fast:.1f}", f"{fast / base:.2f}x", f"{rate:.2f}",
                     f"{accepted / drafts:.2f}" if drafts else "-"])
    print(table(rows, ["batch", "plain tok/s", f"ngram k={args.k} tok/s", "speed-up", "acceptance",
                       "accepted / verify"]))
    plain.shutdown()
    spec.shutdown()
    return alpha


def verify_ms(llm: LLM, batch: int, k: int, ctx: int = 512, iters: int = 20) -> float:
    """Median ms of one forward over `batch` sequences of `ctx` tokens, each with k proposals."""
    eng = llm.engine
    seqs = []
    for i in range(batch):
        s = Sequence(f"v{i}", 0, list(range(2, ctx + 2)), SamplingParams())
        assert eng.kv.allocate(s, ctx + k), "KV cache too small for the verify shape"
        s.num_computed_tokens = ctx - 1
        s.draft_token_ids = [3] * k
        seqs.append(s)
    step = Batch(seqs, [1 + k] * batch)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(iters + 3):
        sync()
        t0 = time.perf_counter()
        eng.runner.run(step)
        sync()
        times.append(time.perf_counter() - t0)
    for s in seqs:
        eng.kv.free(s)
    return sorted(times[3:])[iters // 2] * 1e3


def verify_table(args, alpha: float) -> None:
    bw, _ = measure_ceilings()
    floor_ms = param_count(args.shape) * 2 / bw * 1e3
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(write_shape_folder(args.shape, root), load_format="dummy", max_model_len=2048)
        for b in args.batch:
            decode = verify_ms(llm, b, 0)
            rows = []
            for k in range(1, 9):
                t = verify_ms(llm, b, k)
                tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1  # expected per verify
                rows.append([k, f"{t:.2f}", f"{t / decode:.2f}", f"{tokens * decode / t:.2f}x"])
            print(f"\n{args.shape}, batch {b}: one decode step {decode:.2f} ms (CUDA graph), weight-read floor "
                  f"{floor_ms:.2f} ms; speed-up at acceptance {alpha:.2f}, proposals free\n")
            print(table(rows, ["k", "verify ms (eager)", "verify / decode", "speed-up"]))
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    p.add_argument("--device", default="auto")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculation off above this many running sequences (default: the engine's)")
    p.add_argument("--shape", default=None, help="GPU: also time verify steps of this shape (random weights)")
    args = p.parse_args()
    print(header("Speculative decoding (n-gram)"))
    alpha = end_to_end(args)
    if args.shape and torch.cuda.is_available():
        verify_table(args, alpha)


if __name__ == "__main__":
    main()
