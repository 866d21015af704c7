"""The real Scheduler (core/scheduler.py) against a cost model of a step, on the CPU: what a
scheduling policy does to TTFT, TPOT and throughput before a GPU run. A step costs
max(weights / bandwidth, tokens x 2 x params / matmul rate) + the decodes' KV reads / bandwidth
+ the prefill chunks' attention FLOPs / matmul rate + a fixed host cost; the engine's overlap is
kept (a step is scheduled while the one before runs; its tokens are read when it ends).

Serving follows bench/serve.py (closed loop of --concurrency streams, --prompt / --output tokens,
a level's first requests spread over --ramp seconds, 0: all at once); offline follows
bench/throughput.py (--num-prompts, lengths uniform in [100, 1024], all waiting at the start),
at each --max-num-seqs, in a cache of --cache-tokens (preempted sequences recompute their tokens).
The TTFT floor is one prompt's prefill alone.

    python bench/schedule_model.py [--shape llama3-8b] [--bw 3.0e12] [--mm 620e12] [--join 8192 512]
                                   [--schedule-policy shortest-prefill longest-output]
                                   [--num-prompts 1000 --max-num-seqs 256 448 --cache-tokens 418000]
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, attention_layers, kv_bytes_per_token, param_count, pct, table
from kvship.config import SCHEDULE_POLICIES
from kvship.core.kv_cache_manager import KVCacheManager
from kvship.core.scheduler import Scheduler
from kvship.sampling_params import SamplingParams
from kvship.sequence import Batch, Sequence

HOST_S = 0.6e-3  # a step's host cost the device waits for (launch, sampling)


class StepCost:
    def __init__(self, shape: str, bw: float, mm: float):
        c = SHAPES[shape]
        self.params, self.bw, self.mm = param_count(shape), bw, mm
        self.kv_token = kv_bytes_per_token(shape)
        self.attn_flops = 4 * c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]
                                                                ) * attention_layers(c)

    def __call__(self, batch: Batch) -> float:
        t = max(2 * self.params / self.bw, batch.num_tokens * 2 * self.params / self.mm) + HOST_S
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            ctx = seq.num_computed_tokens
            t += (ctx + 1) * self.kv_token / self.bw if n == 1 else n * (ctx + n / 2) * self.attn_flops / self.mm
        return t


def simulate(cost: StepCost, sched: Scheduler, arrivals: list[tuple[float, Sequence]], on_done=None):
    """Run to the end; returns ({request: TTFT}, {request: TPOT}, seconds, output tokens).
    ``on_done(t)``: a request ended at t; it may return the next (arrival time, sequence)."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    ttft, tpot, first = {}, {}, {}
    now, gpu_free, produced, prev = 0.0, 0.0, 0, None  # prev: (sampled sequences, end time) in flight
    while arrivals or sched.has_work() or prev:
        while arrivals and arrivals[0][0] <= now:
            sched.add(arrivals.pop(0)[1])
        in_flight = prev[0] if prev else set()
        batch = sched.schedule(in_flight)
        if not batch and prev is None:
            now = arrivals[0][0]
            continue
        sampled = {s for s, n in zip(batch.seqs, batch.num_new_tokens)
                   if s.num_computed_tokens + n >= s.num_tokens + (s in in_flight)}
        end = gpu_free = max(now, gpu_free) + (cost(batch) if batch else 0.0)
        sched.commit(batch)
        for s in sampled:  # the engine ends a sequence when it launches its last token
            if s.num_tokens + (s in in_flight) + 1 - s.num_prompt_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
        if prev:
            seqs, t = prev
            now = max(now, t)
            for s in seqs:
                s.token_ids.append(1)
                produced += 1
                if s.num_output_tokens == 1:
                    first[s.request_id] = t
                    ttft[s.request_id] = t - s.arrival_time
                if s.num_output_tokens == s.params.max_tokens:
                    tpot[s.request_id] = (t - first[s.request_id]) / max(1, s.params.max_tokens - 1)
                    if on_done is not None and (nxt := on_done(t)) is not None:
                        arrivals.append(nxt)
                        arrivals.sort(key=lambda a: a[0])
        prev = (sampled, end) if sampled else None
        if prev is None:
            now = max(now, gpu_free)
    return ttft, tpot, now, produced


def _seq(i: int, prompt: int, out: int, t: float = 0.0) -> Sequence:
    seq = Sequence(f"r{i}", 0, [100_000 * i + j for j in range(prompt)], SamplingParams(max_tokens=out, ignore_eos=True))
    seq.arrival_time = t
    return seq


def serving(cost, budget, join, conc, prompt, out, ramp):
    kv = KVCacheManager(num_blocks=(prompt + out) * conc // 16 * 2, block_size=16, enable_prefix_caching=False)
    sched = Scheduler(kv, 256, budget, prefill_join_tokens=join)
    later = iter(range(conc, max(16, 2 * conc)))  # serve.py's requests a level

    def next_request(t: float):
        i = next(later, None)
        return None if i is None else (t, _seq(i, prompt, out, t))

    first = [(ramp * i / conc, _seq(i, prompt, out, ramp * i / conc)) for i in range(conc)]
    ttft, tpot, _, _ = simulate(cost, sched, first, next_request)
    return pct(list(ttft.values()), 0.5), pct(list(ttft.values()), 0.99), pct(list(tpot.values()), 0.5)


def offline(cost, budget, join, num_prompts, policy, max_num_seqs=256, cache_tokens=None, seed=0):
    """Output tok/s and preemptions; ``cache_tokens`` None: a cache that never runs out."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=(cache_tokens or num_prompts * 2048) // 16, block_size=16,
                        enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs, budget, prefill_join_tokens=join, schedule_policy=policy)
    seqs = [_seq(i, rng.randint(100, 1024), rng.randint(100, 1024)) for i in range(num_prompts)]
    _, _, seconds, produced = simulate(cost, sched, [(0.0, s) for s in seqs])
    return produced / seconds, sched.num_preemptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--bw", type=float, default=3.0e12, help="copy bandwidth, bytes/s")
    ap.add_argument("--mm", type=float, default=620e12, help="dense matmul rate, FLOP/s")
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--join", type=int, nargs="+", default=[8192, 512], help="prefill_join_tokens to compare")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--ramp", type=float, nargs="+", default=[1.9, 0.5, 0.0],
                    help="seconds the first requests are spread over (serve.py: one request's duration alone)")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[256], help="offline batch caps to compare")
    ap.add_argument("--cache-tokens", type=int, default=None,
                    help="the KV cache's tokens offline (default: enough that nothing is preempted)")
    ap.add_argument("--schedule-policy", nargs="+", default=list(SCHEDULE_POLICIES), choices=SCHEDULE_POLICIES,
                    help="offline rows for each (serving rows: shortest-prefill)")
    args = ap.parse_args()
    cost = StepCost(args.shape, args.bw, args.mm)
    alone = Batch()
    alone.add(_seq(0, args.prompt, 1), args.prompt)
    rows = []
    for join in args.join:
        for ramp in args.ramp:
            p50, p99, tpot = serving(cost, args.budget, join, args.concurrency, args.prompt, args.output, ramp)
            rows.append([join, f"serving c={args.concurrency}, ramp {ramp:g} s", f"{p50 * 1e3:.0f}",
                         f"{p99 * 1e3:.0f}", f"{tpot * 1e3:.1f}", "-", "-"])
        for policy, cap in itertools.product(args.schedule_policy, args.max_num_seqs):
            rate, preempted = offline(cost, args.budget, join, args.num_prompts, policy, cap, args.cache_tokens)
            rows.append([join, f"offline, {args.num_prompts} prompts, {policy}, cap {cap}", "-", "-", "-",
                         f"{rate:,.0f}", preempted])
    print(f"{args.shape}, bandwidth {args.bw / 1e12:.2f} TB/s, matmul {args.mm / 1e12:.0f} TFLOP/s, budget "
          f"{args.budget}; TTFT floor (one {args.prompt}-token prefill alone): {cost(alone) * 1e3:.1f} ms\n")
    print(table(rows, ["prefill_join_tokens", "workload", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "out tok/s",
                       "preemptions"]))


if __name__ == "__main__":
    main()
