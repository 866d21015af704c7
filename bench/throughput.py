"""Offline throughput: N prompts with input and output lengths uniform in [lo, hi], random
tokens, ignore_eos. Output tok/s next to the workload's own limit and HF transformers.

The limit: decode steps each read all weights once (at most max_num_seqs sequences per step;
with routed experts, those the step's tokens pick under uniform routing: ``experts_read``)
over the measured copy bandwidth, or the decoded tokens' FLOPs (2 x params each) over the
measured matmul rate, whichever is slower (a step of a few hundred rows is compute-bound on a
GPU); plus every generated token's KV context over the copy bandwidth; plus the prefill FLOPs
(2 x params x prompt tokens) over the matmul rate. A FLOP count leaves out the input embedding
(a lookup), and a prompt token's the LM head. The KV bytes are the configuration's own:
--kv-cache-dtype fp8 halves them, so its limit is higher; so are the weight bytes with
--quantization (the bytes the loaded layers hold; the FLOP terms keep the bf16 matmul rate, so
an FP8 W8A8 limit is lenient there).

    python bench/throughput.py [--shape llama3-8b] [--num-prompts 1000] [--max-num-seqs N]
                               [--kv-cache-dtype auto fp8 ...] [--quantization none fp8 ...] [--tp 1 2]
                               [--schedule-policy shortest-prefill longest-output] [--profile TOP]

Several weight formats (none: 16-bit), KV-cache dtypes, TP sizes and schedule policies run in turn, each configuration
in its own engine (shut down before the next starts), and share one table: each row beside its own
limit, in the same run. Without --max-num-seqs each engine picks its batch cap from its KV cache's
size (the "seqs" column).

The table's last columns count the engine's steps by kind: decodes alone (CUDA graphs), prompt
chunks alone, and mixed (both; eager). --profile runs the kvship pass under torch.profiler and
prints its TOP kernels by device time over the whole run (the profiler slows the host, so that
run's tok/s is not comparable).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    SHAPES,
    WEIGHT_FORMATS,
    expert_bytes_per_token,
    experts_read,
    header,
    insitu_method,
    kernel_rows,
    kv_bytes_per_token,
    matmul_param_counts,
    measure_ceilings,
    param_count,
    state_bytes_per_token,
    table,
    weight_bytes_per_token,
    write_shape_folder,
)
from kvship.config import OFFLINE_SCHEDULE_POLICY, SCHEDULE_POLICIES
from kvship.llm import LLM
from kvship.sampling_params import SamplingParams


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ins = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    outs = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(2, vocab, (k,), generator=g).tolist() for k in ins]
    return prompts, outs


def limit_seconds(shape: str, prompts, outs, max_num_seqs: int, bw: float, mm: float,
                  kv_cache_dtype: str = "auto", weight_bytes: int | None = None, expert_bytes: int = 0,
                  state_bytes: int = 0) -> float:
    """expert_bytes: the routed experts' share of weight_bytes (k of E); a full step of
    max_num_seqs tokens reads experts_read times as many. state_bytes: a hybrid's recurrent
    state, read and written once for every generated token."""
    params = param_count(shape)
    decode_params, prompt_params = matmul_param_counts(shape)
    weight_bytes = weight_bytes or params * 2
    weight_bytes += expert_bytes * (experts_read(shape, max_num_seqs) - 1)
    steps = -(-sum(outs) // max_num_seqs)
    kv_reads = sum(len(p) * o + o * (o + 1) // 2 for p, o in zip(prompts, outs)) * kv_bytes_per_token(
        shape, kv_cache_dtype=kv_cache_dtype)
    prefill_flops = 2 * prompt_params * sum(len(p) for p in prompts)
    # the decode steps' weights: read once a step, or multiplied by every decoded token
    decode_weights = max(steps * weight_bytes / bw, 2 * decode_params * sum(outs) / mm)
    return decode_weights + (kv_reads + sum(outs) * state_bytes) / bw + prefill_flops / mm


def time_gpu_work(obj, method: str, spans: list) -> None:
    """Wrap obj.method so that each call's GPU work is bracketed by CUDA events (read at the end)."""
    inner = getattr(obj, method)

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = inner(*args, **kwargs)
        end.record()
        spans.append((start, end))
        return result

    setattr(obj, method, timed)


def count_steps(runner, kinds: dict[str, int]) -> None:
    """Wrap runner.run so that each step is counted in ``kinds`` by what its batch holds."""
    inner = runner.run

    def counted(batch, *args, **kwargs):
        decodes = batch.num_decodes
        kinds["decode" if decodes == len(batch) else "mixed" if decodes else "prefill"] += 1
        return inner(batch, *args, **kwargs)

    runner.run = counted


def shifted(prompts, i: int, vocab: int):
    """Pass i's prompts: the same lengths, every token moved by i, so that no pass hits the
    prefix cache that an earlier one filled."""
    return [[(t + i) % vocab for t in p] for p in prompts]


def run_kvship(folder, prompts, outs, max_num_seqs: int | None, kv_cache_dtype: str = "auto",
               quantization: str | None = None, tp: int = 1, profile: int = 0, *, passes: int = 1, vocab: int,
               schedule_policy: str = OFFLINE_SCHEDULE_POLICY):
    """Per pass over the workload (``passes`` in one engine; prompts ``shifted``): (seconds, output
    tokens, fraction of the wall time inside the events bracketing each forward pass and each
    sampling: an upper bound on GPU busy time, so 1 - it is a lower bound on idle, the steps by
    kind); then the weight bytes a batch-1 decode step reads with the routed experts' share of
    them: on rank 0 at tp > 1, whose GPU times are the ones bracketed; with ``profile``, that
    many kernels' rows of the first pass's profile; the batch cap the engine ran with; the recurrent-state
    bytes a generated token reads and writes (hybrids; 0 for others)."""
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=2 * max(map(len, prompts)) + 16,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, kv_cache_dtype=kv_cache_dtype,
              quantization=quantization, tensor_parallel_size=tp, schedule_policy=schedule_policy)
    seqs = llm.engine.config.max_num_seqs
    weight_bytes = weight_bytes_per_token(llm.engine.runner.model)
    expert_bytes = expert_bytes_per_token(llm.engine.runner.model)
    state_bytes = state_bytes_per_token(llm.engine.runner.model, llm.engine.runner.dtype)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(shifted(prompts[:4], passes, vocab), params[:4])  # warm-up, shifted past every pass
    spans: list = []
    kinds = {"decode": 0, "prefill": 0, "mixed": 0}
    time_gpu_work(llm.engine.runner, "run", spans)
    count_steps(llm.engine.runner, kinds)
    time_gpu_work(llm.engine.runner.sampler, "launch", spans)
    results, prof_rows = [], []
    for i in range(passes):
        spans.clear()
        kinds.update(dict.fromkeys(kinds, 0))
        torch.cuda.synchronize()
        with contextlib.ExitStack() as stack:
            prof = stack.enter_context(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                                       ) if profile and i == 0 else None
            t0 = time.monotonic()
            res = llm.generate(shifted(prompts, i, vocab), params)
            torch.cuda.synchronize()
            dt = time.monotonic() - t0
        busy = sum(s.elapsed_time(e) for s, e in spans) / 1e3
        produced = sum(len(r.outputs[0].token_ids) for r in res)
        assert produced == sum(outs), "every request must produce exactly max_tokens tokens"
        results.append((dt, produced, busy / dt, dict(kinds)))
        if prof:
            prof_rows = kernel_rows(prof, 1, profile)
    llm.shutdown()  # its memory back before the next configuration's engine starts
    return results, weight_bytes, expert_bytes, prof_rows, seqs, state_bytes


def run_hf(shape: str, prompts, outs, batch: int) -> float:
    """HF generate over a subset (it is slow), left-padded batches of `batch` prompts."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    produced, t0 = 0, time.monotonic()
    for i in range(0, len(prompts), batch):
        ps, new = prompts[i:i + batch], max(outs[i:i + batch])
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device="cuda")
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        produced += new * len(ps)
    torch.cuda.synchronize()
    rate = produced / (time.monotonic() - t0)
    del model
    torch.cuda.empty_cache()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--lo", type=int, default=100)
    ap.add_argument("--hi", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="batch cap (default: the engine's, from its cache)")
    ap.add_argument("--hf-prompts", type=int, default=64, help="subset size for the HF reference (0: skip)")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                    choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4"])
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", *WEIGHT_FORMATS],
                    help="in-situ weight formats, each run in turn (none: 16-bit; fp8-block: a scale per 128 x 128 "
                         "block, as block-wise checkpoints)")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="profile the kvship pass, print TOP kernels")
    ap.add_argument("--passes", type=int, default=1,
                    help="passes over the workload in one engine; the row shows the median pass and lists them all "
                         "(H200 runs of one tree differed by up to 7%%)")
    ap.add_argument("--schedule-policy", nargs="+", default=[OFFLINE_SCHEDULE_POLICY], choices=SCHEDULE_POLICIES,
                    help="the engine's admission order, each run in turn (longest-output, LLM's default: most "
                         "max_tokens first)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes, each run in turn (e.g. 1 2: TP=1 and TP=2 in the same run)")
    args = ap.parse_args()
    bw, mm = measure_ceilings()
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts, outs = workload(args.num_prompts, args.lo, args.hi, vocab)
    t0 = time.monotonic()
    rows, limits, profiles, first = [], {}, [], 0.0
    for wfmt, kv, tp, policy in itertools.product(args.quantization, args.kv_cache_dtype, args.tp, args.schedule_policy):
        config = f"{'bf16' if wfmt == 'none' else wfmt} weights, {kv} KV" + (f", TP={tp}" if args.tp != [1] else "")
        config += f", {policy}" if len(args.schedule_policy) > 1 else ""
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_shape_folder(args.shape, tmp)
            results, wbytes, ebytes, prof_rows, seqs, sbytes = run_kvship(
                folder, prompts, outs, args.max_num_seqs, kv, insitu_method(wfmt), tp, args.profile,
                passes=args.passes, vocab=vocab, schedule_policy=policy)
        dt, produced, busy, kinds = sorted(results)[len(results) // 2]  # the median pass (by seconds)
        # tp GPUs side by side: each reads its shard (rank 0's bytes), 1/tp of the KV and of the FLOPs
        limits[config] = limit_seconds(args.shape, prompts, outs, seqs, bw * tp, mm * tp, kv,
                                       wbytes * tp, ebytes * tp, sbytes * tp)
        print(f"kvship {config} done after {time.monotonic() - t0:.0f} s ({dt:.1f} s of generation)",
              file=sys.stderr, flush=True)
        name = f"kvship, {config}"
        if len(results) > 1:
            name += " (median of passes " + " / ".join(f"{p / d:,.0f}" for d, p, _, _ in results) + ")"
        rate = produced / dt
        first = first or rate
        rows.append([name, f"{rate:,.0f}", f"{rate / first:.2f}×", f"{dt:.1f}", f"{100 * limits[config] / dt:.0f}%",
                     f"{100 * (1 - busy):.0f}%", f"{seqs}", *(f"{kinds[k]:,}" for k in ("decode", "mixed", "prefill"))])
        profiles.append((name, prof_rows))
    if args.hf_prompts:
        hf = run_hf(args.shape, prompts[:args.hf_prompts], outs[:args.hf_prompts], args.hf_batch)
        print(f"HF done after {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        rows.append([f"HF transformers generate, batch {args.hf_batch} ({args.hf_prompts} prompts)", f"{hf:,.0f}",
                     *"-" * 8])
    for config, limit in limits.items():
        rows.append([f"workload limit, {config} (bytes / BW, FLOPs / matmul)", f"{sum(outs) / limit:,.0f}",
                     "-", f"{limit:.1f}", "100%", "0%", *"-" * 4])
    print(header(f"Offline throughput, {args.shape} shape, {args.num_prompts} prompts, "
                 f"in/out uniform [{args.lo}, {args.hi}], max_num_seqs {args.max_num_seqs or 'per engine'}"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, "
          f"{sum(map(len, prompts)):,} prompt tokens, {sum(outs):,} output tokens\n")
    print(table(rows, ["engine", "output tok/s", "of the first row", "seconds", "of limit", "GPU idle", "seqs", "decode steps", "mixed steps",
                       "prefill steps"]))
    for name, prof_rows in profiles:
        if prof_rows:
            print(f"\nKernels over the whole run, {name} (under the profiler):\n")
            print(table(prof_rows, ["kernel", "µs", "launches", "share"]))


if __name__ == "__main__":
    main()
