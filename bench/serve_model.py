"""The real server on the step cost model, on the CPU: `kvship serve` of a tiny random model
whose runner computes nothing and hands each step's tokens over when schedule_model.py's cost
model of the shape (Llama-3-8B by default) says the GPU would have finished it. bench/serve.py's
levels run against it (streaming, closed loop, the first requests of a level spread over
--ramp seconds), beside schedule_model's prediction for the same arrivals. The server's side
runs for real: HTTP, streaming, the engine thread and its scheduler; where the two disagree,
that is what differs.

    python bench/serve_model.py [--shape llama3-8b] [--concurrency 64] [--ramp 1.46] [--launch-ms 0]
                                [--server-arg=--prefill-join-tokens=8192]

--ramp: one request's duration at concurrency 1, as serve.py measures it (1.46 s on an H100).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, pct, table, write_shape_folder
from kvship.config import SERVE_PREFILL_JOIN_TOKENS
from schedule_model import HOST_S, StepCost, serving
from serve import free_port, popen_logged, run_level, server_means_ms, server_sums, wait_ready

TOKEN = 5  # every sampled token (requests ignore eos)


class ModelledSample:
    """A step's sample that is ready when the modelled GPU ends the step."""

    def __init__(self, rows: int, ready: float):
        self.rows, self.ready = rows, ready

    def result(self):
        from kvship.runner.sampler import SamplerOutput

        time.sleep(max(0.0, self.ready - time.monotonic()))  # the GIL is free meanwhile, as in a CUDA wait
        return SamplerOutput([TOKEN] * self.rows, [None] * self.rows)


def model_the_runner(cost: StepCost, launch_s: float) -> None:
    """ModelRunner's forward (``run``) and ``sample`` replaced, its ``start`` kept: no forward, the
    step queued behind the one before on the modelled device (the real runner's host cost left
    out of the model's step), its "logits" the time the device ends it. A step with prompt tokens
    first holds the GIL for ``launch_s``, as an eager forward's launches do."""
    from kvship.runner.model_runner import ModelRunner

    device_free = [0.0]

    def run(self, batch, previous=None):
        if launch_s and batch.num_tokens > len(batch.seqs):
            until = time.perf_counter() + launch_s
            while time.perf_counter() < until:  # busy: the GIL held
                pass
        device_free[0] = max(time.monotonic(), device_free[0]) + cost(batch) - HOST_S
        return device_free[0]

    def sample(self, step, allowed=None):
        if step.logits is not None:
            step.sample, step.logits = ModelledSample(len(step.sampled), step.logits), None
        return step

    ModelRunner.run, ModelRunner.sample = run, sample


def serve_child(argv: list[str]) -> None:
    """This file run as the server: the runner modelled, then `kvship serve` with argv."""
    shape, bw, mm, launch_ms, *serve_args = argv
    model_the_runner(StepCost(shape, float(bw), float(mm)), float(launch_ms) / 1e3)
    from kvship.cli import main

    sys.exit(main(["serve", *serve_args]))


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return serve_child(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--bw", type=float, default=3.0e12, help="copy bandwidth, bytes/s")
    ap.add_argument("--mm", type=float, default=620e12, help="dense matmul rate, FLOP/s")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens, as on a GPU")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64])
    ap.add_argument("--ramp", type=float, default=1.46)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--launch-ms", type=float, default=0.0,
                    help="host time an eager step (one with prompt tokens) holds the GIL launching its kernels")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `kvship serve` argument (repeatable)")
    args = ap.parse_args()
    join = next((int(a.split("=", 1)[1]) for a in args.server_arg if a.startswith("--prefill-join-tokens=")),
                SERVE_PREFILL_JOIN_TOKENS)
    cost = StepCost(args.shape, args.bw, args.mm)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_shape_folder("tiny", tmp)
        # the GPU's defaults: the whole budget for prompts, beside decodes too
        extra = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench", "--device", "cpu",
                 "--load-format", "dummy", "--max-model-len", str(args.prompt + args.output + 16),
                 "--max-num-batched-tokens", str(args.budget), "--prefill-beside-decodes", str(args.budget),
                 "--max-num-seqs", "256", *args.server_arg]
        proc = popen_logged([sys.executable, __file__, "--child", args.shape, str(args.bw), str(args.mm),
                             str(args.launch_ms), folder, *extra])
        try:
            wait_ready(proc, base)
            asyncio.run(run_level(base, 1, 2, 16, 4, 512, seed=99))  # warm-up
            for conc in args.concurrency:
                n = max(16, 2 * conc)
                before = server_sums(base)
                res, wall = asyncio.run(run_level(base, conc, n, args.prompt, args.output, 512, seed=conc,
                                                  ramp_s=args.ramp))
                ttft, tpot = [r[0] for r in res], [r[1] for r in res]
                m50, m99, mtpot = serving(cost, args.budget, join, conc, args.prompt, args.output,
                                          args.ramp)
                rows.append([conc, f"{pct(ttft, .5) * 1e3:.0f}", f"{pct(ttft, .99) * 1e3:.0f}",
                             f"{pct(tpot, .5) * 1e3:.1f}", *server_means_ms(before, server_sums(base)),
                             f"{m50 * 1e3:.0f}", f"{m99 * 1e3:.0f}", f"{mtpot * 1e3:.1f}"])
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"The server on the {args.shape} cost model (bandwidth {args.bw / 1e12:.2f} TB/s, matmul "
          f"{args.mm / 1e12:.0f} TFLOP/s, budget {args.budget}, join {join}, eager launch "
          f"{args.launch_ms:g} ms), prompt {args.prompt}, output {args.output}, first requests over {args.ramp} s\n")
    print(table(rows, ["concurrency", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "server TTFT ms", "queue ms",
                       "prefill ms", "model alone: TTFT p50", "p99", "TPOT p50"]))


if __name__ == "__main__":
    main()
