"""Speculative decoding: output tok/s with and without n-gram speculation on a copy-heavy prompt
set (the bundled SmolLM2, real weights: acceptance means something), per batch size, with the
acceptance rate measured in the same run; and, with --shape on a GPU (random weights, no bundled
model needed with --acceptance), the time of one verify step (k + 1 query tokens a sequence) for
k = 1..8 at each batch size, replayed from the verify CUDA graphs and run eagerly, against one
decode step (its CUDA graph) and against the hardware limit (weight bytes / measured copy
bandwidth, or the rows' FLOPs / measured matmul peak), with the speed-up those times give at
each acceptance, the best k per batch, and the batch at which speculation stops paying (the
engine's disable_by_batch_size).

    python bench/spec_decode.py [--k 4] [--batch 1 8 32 64] [--output 128]
    python bench/spec_decode.py --shape llama3-8b --acceptance 0.5 0.7 [--batch 1 8 16 32 48 64] [--context 512]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import _time_cuda, header, measure_ceilings, param_count, table, write_shape_folder
from kvship.llm import LLM
from kvship.runner.verify_graphs import VerifyGraphs
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


def verify_batch(llm: LLM, batch: int, k: int, ctx: int) -> Batch:
    """`batch` sequences of `ctx` tokens, each with k proposals (0: a plain decode step)."""
    seqs = []
    for i in range(batch):
        s = Sequence(f"v{i}", 0, list(range(2, ctx + 2)), SamplingParams())
        assert llm.engine.kv.allocate(s, ctx + k), "KV cache too small for the verify shape"
        s.num_computed_tokens = ctx - 1
        s.draft_token_ids = [3] * k
        seqs.append(s)
    return Batch(seqs, [1 + k] * batch)


def step_ms(llm: LLM, step: Batch, iters: int = 20) -> float:
    """Mean ms of one forward of `step`, on CUDA events over back-to-back steps after warm-up."""
    run = lambda: llm.engine.runner.run(step)  # noqa: E731
    ms = _time_cuda(run, iters) * 1e3
    for s in step.seqs:
        llm.engine.kv.free(s)
    return ms


def tokens_per_verify(alpha: float, k: int) -> float:
    """Expected tokens a verify of k proposals yields when each is accepted with probability alpha."""
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1


def verify_table(args, alphas: list[float]) -> None:
    """Table 2 per batch: decode vs verify (graphs and eager) for k = 1..8 and the speed-ups at
    each acceptance; then the best k per batch and the batch at which speculation stops paying."""
    bw, flops = measure_ceilings()
    params = param_count(args.shape)
    max_bs = max(args.batch)
    best: dict[tuple[int, float], tuple[int, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        llm = LLM(write_shape_folder(args.shape, root), load_format="dummy", dtype="bfloat16",
                  max_model_len=args.context + 64, max_num_seqs=max_bs)
        runner = llm.engine.runner
        assert runner.graphs is not None, "the decode graphs are off: the comparison needs them"
        timings = {b: {0: step_ms(llm, verify_batch(llm, b, 0, args.context))} for b in args.batch}
        for k in range(1, 9):
            runner.verify_graphs = VerifyGraphs(runner.model, max_bs, k + 1, runner.max_model_len, runner.block_size,
                                                runner.device)
            runner.verify_graphs.capture(runner.graphs.pool)
            for b in args.batch:
                graph = step_ms(llm, verify_batch(llm, b, k, args.context))
                graphs, runner.verify_graphs = runner.verify_graphs, None
                eager = step_ms(llm, verify_batch(llm, b, k, args.context))
                runner.verify_graphs = graphs
                timings[b][k] = (graph, eager)
            runner.verify_graphs = None
        llm.shutdown()
    floor_ms = params * 2 / bw * 1e3  # bf16 weights read once a step
    for b in args.batch:
        decode = timings[b][0]
        rows = []
        for k in range(1, 9):
            graph, eager = timings[b][k]
            limit = max(floor_ms, 2 * params * b * (k + 1) / flops * 1e3)
            ups = [tokens_per_verify(a, k) * decode / graph for a in alphas]
            for a, up in zip(alphas, ups):
                if up > best.get((b, a), (0, 0.0))[1]:
                    best[(b, a)] = (k, up)
            rows.append([k, b * (k + 1), f"{graph:.2f}", f"{eager:.2f}", f"{limit:.2f}", f"{graph / decode:.2f}",
                         *(f"{up:.2f}x" for up in ups)])
        print(f"\n{args.shape}, batch {b}, context {args.context}: one decode step {decode:.2f} ms (CUDA graph); "
              f"weight-read floor {floor_ms:.2f} ms ({params * 2 / 1e9:.1f} GB at {bw / 1e9:.0f} GB/s)\n")
        print(table(rows, ["k", "rows", "verify ms (graph)", "verify ms (eager)", "limit ms", "verify / decode",
                           *(f"speed-up @ {a:.2f}" for a in alphas)]))
    print("\nBest k per batch (proposals free, as n-gram lookup nearly is); limit: max(weights / bandwidth, "
          "FLOPs / matmul peak)\n")
    print(table([[b, *(f"k={best[(b, a)][0]}: {best[(b, a)][1]:.2f}x" for a in alphas)] for b in args.batch],
                ["batch", *(f"acceptance {a:.2f}" for a in alphas)]))
    for a in alphas:
        stops = next((b for b in args.batch if best[(b, a)][1] <= 1.0), None)
        pays = [b for b in args.batch if stops is None or b < stops]
        print(f"\nacceptance {a:.2f}: speculation pays up to batch {pays[-1] if pays else '-'} "
              f"(disable_by_batch_size {pays[-1] if pays else 0}); "
              + (f"it stops paying at batch {stops}" if stops else "it pays at every batch measured"))


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
    p.add_argument("--context", type=int, default=512, help="--shape: each sequence's context")
    p.add_argument("--acceptance", type=float, nargs="+", default=None,
                   help="--shape: the acceptance rates to compute speed-ups at, instead of running the bundled "
                        "model's copy-heavy set for one (that set is skipped)")
    args = p.parse_args()
    print(header("Speculative decoding (n-gram)"))
    alphas = args.acceptance or [end_to_end(args)]
    if args.shape and torch.cuda.is_available():
        verify_table(args, alphas)


if __name__ == "__main__":
    main()
