"""Tensor parallelism on one host's GPUs: (1) greedy output at TP=N equals TP=1 on a random-weight
Llama shape (fp32 by default; where tokens part, the logits at that step are compared and the TP=1 top-2
margin is shown), (2) batch-1 decode tok/s of a model shape at TP=1 and TP=N, one row per all-reduce
(--all-reduce, default NCCL and the fused all-reduce + residual add + RMSNorm), (3) each latency
configuration's per-step kernel profile (rank 0, CUDA-graph replays).

    python bench/tp_latency.py [--tp 2] [--shape llama3-8b] [--check-shape llama-1b] [--prompt 512] [--output 256]
        [--all-reduce nccl fused] [--check-all-reduce fused]

Each configuration runs in its own process (a clean GPU, and a hang or crash stays contained).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, kv_bytes_per_token, measure_batch1, param_count, table, write_shape_folder

SHAPES.setdefault("llama-1b", dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=500000.0,
    max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1))


def one_check(folder: str, tp: int, out_path: str, dtype: str, all_reduce: str = "nccl") -> None:
    """Greedy tokens and per-step logits (first rows) at this TP size, saved for comparison."""
    from kvship.llm import LLM
    from kvship.sampling_params import SamplingParams

    llm = LLM(folder, load_format="dummy", dtype=dtype, tensor_parallel_size=tp, max_model_len=1024,
              max_num_seqs=8, kv_cache_memory=4 << 30, tp_all_reduce=all_reduce)
    print(f"fused all-reduce + RMSNorm active: {llm.engine.runner.tp.fused_norm is not None}"
          if tp > 1 and hasattr(llm.engine.runner, "tp") else "", file=sys.stderr, flush=True)
    steps: list[torch.Tensor] = []
    rows: list[list[str]] = []  # request id of each logits row, per step
    run = llm.engine.runner.run

    def recording_run(b, *prev):
        rows.append([s.request_id for s, n in zip(b.seqs, b.num_new_tokens) if s.num_computed_tokens + n >= s.num_tokens])
        logits = run(b, *prev)
        steps.append(logits.float().cpu())
        return logits  # stays on the GPU: the sampled tokens feed the next step there
    llm.engine.runner.run = recording_run
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (7, 33, 120, 300)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    torch.save({"tokens": [o.outputs[0].token_ids for o in outs], "steps": steps, "rows": rows,
                "ids": [o.request_id for o in outs]}, out_path)
    print("saved", flush=True)  # the result stands even if teardown then hangs
    llm.engine.shutdown()


def one_latency(folder: str, tp: int, prompt_len: int, out_len: int, all_reduce: str) -> dict:
    from kvship.llm import LLM

    t0 = time.monotonic()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp,
              max_model_len=prompt_len + out_len + 16, max_num_seqs=8, tp_all_reduce=all_reduce)
    load_s = time.monotonic() - t0
    ttft, rate = measure_batch1(llm, prompt_len, out_len)
    result = {"tp": tp, "all_reduce": all_reduce, "tok_s": rate, "ttft_s": ttft, "start_s": load_s}
    try:
        result["profile"] = profile_decode(llm, prompt_len)
    except Exception as e:  # noqa: BLE001 - the figure above stands without the profile
        result["profile_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(result), flush=True)  # before teardown: the figure stands even if teardown hangs
    llm.engine.shutdown()
    return result


def profile_decode(llm, prompt_len: int, steps: int = 24) -> list:
    """Rank 0's kernels per batch-1 decode step (CUDA-graph replays): [[name, µs, launches], ...]."""
    from collections import defaultdict

    from kvship.sampling_params import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    eng.add_request("profile", torch.randint(2, eng.model_config.vocab_size, (prompt_len,), generator=g).tolist(),
                    params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(4):
        eng.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    while eng.scheduler.running or eng.scheduler.waiting:
        eng.step()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            rec = per[e.name[:70]]
            rec[0] += e.time_range.elapsed_us() / steps
            rec[1] += 1 / steps
    rows = sorted(([k, v[0], v[1]] for k, v in per.items()), key=lambda r: -r[1])
    return rows[:10] + [["total (all kernels)", sum(r[1] for r in rows), sum(r[2] for r in rows)]]


def _child(args: list[str], timeout: float) -> tuple[int, str]:
    try:
        p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
        sys.stderr.write(p.stderr[-6000:])
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        def text(b) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        sys.stderr.write(text(e.stderr)[-6000:])
        out = text(e.stdout)
        return (0 if out.strip() else 124), out  # finished, then stuck in teardown: keep the result


def compare(a: dict, b: dict) -> list[str]:
    lines = []
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    lines.append(f"greedy sequences identical: {same}/{len(a['tokens'])}")
    first = a["steps"][0].float(), b["steps"][0].float()
    lines.append(f"prefill logits max |TP=1 - TP=N| = {(first[0] - first[1]).abs().max().item():.4g} "
                 f"(logit std {first[0].std().item():.3g})")
    def logits_of(run: dict, rid: str, k: int) -> torch.Tensor:
        seen = 0
        for rows, logits in zip(run["rows"], run["steps"]):
            if rid in rows:
                if seen == k:
                    return logits[rows.index(rid)]
                seen += 1
        raise KeyError(rid)

    for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        if x != y:  # same context up to here: is it a near tie that bf16 rounding flips?
            k = next(j for j, (u, v) in enumerate(zip(x, y)) if u != v)
            la, lb = logits_of(a, a["ids"][i], k), logits_of(b, b["ids"][i], k)
            lines.append(f"sequence {i} parts at output token {k}: TP=1 logits of the two choices differ by "
                         f"{(la[x[k]] - la[y[k]]).item():.4g}, TP=N by {(lb[y[k]] - lb[x[k]]).item():.4g}; "
                         f"max |TP=1 - TP=N| over that step's logits {(la - lb).abs().max().item():.4g}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--check-shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--check-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="random weights give near-ties that bf16 rounding flips; fp32 isolates sharding errors")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--all-reduce", nargs="+", default=["nccl", "fused"], choices=["nccl", "one-shot", "fused"],
                    help="TP=N latency rows, one per all-reduce")
    ap.add_argument("--check-all-reduce", default="fused", choices=["nccl", "one-shot", "fused"])
    ap.add_argument("--timeout", type=float, default=150, help="seconds per configuration")
    ap.add_argument("--_one", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        kind, folder, tp = args._one[0], args._one[1], int(args._one[2])
        if kind == "check":
            one_check(folder, tp, args._one[3], args._one[4], args._one[5])
        else:
            one_latency(folder, tp, args.prompt, args.output, all_reduce=kind)
        return

    lines = [header(f"Tensor parallelism: TP=1 vs TP={args.tp}, random weights")]
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_check:
            folder = write_shape_folder(args.check_shape, tmp)
            res = {}
            for tp in (1, args.tp):
                path = os.path.join(tmp, f"check{tp}.pt")
                code, _ = _child(["--_one", "check", folder, str(tp), path, args.check_dtype,
                                  args.check_all_reduce], args.timeout)
                res[tp] = torch.load(path) if os.path.exists(path) else None
                print(f"check TP={tp}: exit {code}", file=sys.stderr, flush=True)
            lines.append(f"### Greedy output, {args.check_shape} shape, {args.check_dtype}, 4 prompts x 48 tokens, "
                         f"CUDA graphs, TP={args.tp} all-reduce {args.check_all_reduce}\n")
            if res[1] is not None and res[args.tp] is not None:
                lines += [f"- {s}" for s in compare(res[1], res[args.tp])]
            else:
                lines.append(f"- a run failed: TP=1 {'ok' if res[1] else 'failed'}, "
                             f"TP={args.tp} {'ok' if res[args.tp] else 'failed'}")
            print("\n".join(lines), flush=True)

        folder = write_shape_folder(args.shape, tmp)
        rows = []
        weight_bytes = param_count(args.shape) * 2
        per_token = weight_bytes + (args.prompt + args.output / 2) * kv_bytes_per_token(args.shape)
        names = {"nccl": "CUDA graphs, NCCL all-reduce", "one-shot": "CUDA graphs, one-shot all-reduce",
                 "fused": "CUDA graphs, fused all-reduce + add + RMSNorm"}
        profiles = []
        for tp in () if args.no_latency else (1, args.tp):
            for kind in args.all_reduce if tp > 1 else ("nccl",):
                code, out = _child(["--prompt", str(args.prompt), "--output", str(args.output),
                                    "--_one", kind, folder, str(tp)], args.timeout)
                print(f"latency TP={tp} {kind}: exit {code} {out.strip()}", file=sys.stderr, flush=True)
                label = f"TP={tp} ({names[kind] if tp > 1 else 'CUDA graphs'})"
                result = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
                if result:  # printed before teardown: it stands whatever the exit code
                    r = json.loads(result[-1])
                    profiles.append((label, r.get("profile"), r.get("profile_error")))
                    if code != 0:
                        label += f" [exit {code} at teardown]"
                    rows.append([label, f"{r['tok_s']:.1f}", f"{r['ttft_s'] * 1e3:.1f}", f"{r['start_s']:.0f}"])
                else:
                    rows.append([label, f"failed (exit {code})", "-", "-"])
        base = next((float(r[1]) for r in rows if r[0].startswith("TP=1 ") and r[1][0].isdigit()), None)
        for r in rows:
            try:
                r.append(f"{float(r[1]) / base:.2f}x" if base else "-")
            except ValueError:
                r.append("-")
    lines.append(f"\n### Batch-1 decode, {args.shape} shape, prompt {args.prompt}, output {args.output}\n")
    lines.append(f"weights {weight_bytes / 1e9:.2f} GB; one GPU's roofline at 4.28 TB/s: "
                 f"{4.28e12 / per_token:.0f} tok/s\n")
    lines.append(table(rows, ["configuration", "decode tok/s", "TTFT ms", "start s", "vs TP=1"]))
    for label, prof, err in profiles:
        lines.append(f"\n### Per-step kernels, rank 0, batch-1 decode (CUDA-graph replays): {label}\n")
        if prof:
            lines.append(table([[n[:70], f"{us:.1f}", f"{k:.1f}"] for n, us, k in prof],
                               ["kernel", "µs / step", "launches / step"]))
        else:
            lines.append(f"- no profile ({err})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
