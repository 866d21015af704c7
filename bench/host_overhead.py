"""Host (Python) time per engine step, measured on the CPU with a tiny model so that the
forward pass costs almost nothing: what a GPU would sit idle for if nothing overlapped it.
Prints a table per batch size; --profile adds the top functions by own time; --waiting N queues
N more requests behind a full batch, as an offline run holds them; --final-only adds them as
LLM.generate does (no output until a request finishes), else as a server does (one a step).

    python bench/host_overhead.py [--batch 1 64 256] [--steps 200] [--waiting 0] [--profile] [--final-only]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_shape_folder
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--waiting", type=int, default=0, help="requests queued behind the full batch")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--final-only", action="store_true",
                    help="requests as LLM.generate adds them: an output only when finished (else as a server's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder("tiny", tmp)
        rows = []
        for bs in args.batch:
            llm = LLM(folder, load_format="dummy", device="cpu", max_num_seqs=bs,
                      max_model_len=args.prompt_len + args.steps + 8, max_num_batched_tokens=8192)
            eng = llm.engine
            params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
            for i in range(bs + args.waiting):
                eng.add_request(f"r{i}", [2 + (i + j) % 500 for j in range(args.prompt_len)], params,
                                final_only=args.final_only)
            running = eng.scheduler.running
            while len(running) < bs or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
                eng.step()  # prefill
            runner_time = [0.0]
            inner = eng.runner.forward

            def timed(*a, **k):
                t = time.perf_counter()
                r = inner(*a, **k)
                runner_time[0] += time.perf_counter() - t
                return r

            eng.runner.forward = timed
            prof = cProfile.Profile() if args.profile else None
            steps = 0
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            while eng.has_work() and steps < args.steps - 2:
                eng.step()
                steps += 1
            if prof:
                prof.disable()
            dt = time.perf_counter() - t0
            rows.append([bs, steps, f"{dt / steps * 1e3:.2f}", f"{runner_time[0] / steps * 1e3:.2f}",
                         f"{(dt - runner_time[0]) / steps * 1e3:.2f}"])
            if prof:
                print(f"\n### batch {bs}: top functions by own time\n```")
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
                print("```")
            llm.shutdown()  # before the next engine starts: each batch size runs alone, as in its own process
        print(table(rows, ["batch", "decode steps", "ms / step", "of which forward", "host ms / step"]))


if __name__ == "__main__":
    main()
