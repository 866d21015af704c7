"""The paged decode-attention kernel alone, per KV-cache layout (16-bit, FP8, int4), over a grid
of launch settings: Llama-3-8B's attention (32 query heads, 8 KV heads, head size 128, block
size 16), batch 32 at 8k-token contexts (the KV-bound decode of bench/kv_decode.py), then the
best settings of each layout at batch 1 / 32k and batch 128 / 2k. Each setting is first checked
against the torch reference on two sequences, then timed from a CUDA graph (CUDA events, after
warm-up, random pages). % BW = the layout's bytes (codes and scales of every key and value
read, the queries and outputs) ÷ time ÷ copy bandwidth measured in the same run.

    python bench/kv_attention_sweep.py [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import kv_quant as kvq
from kvship.kernels import paged_attention as pa

HQ, HKV, D, BS = 32, 8, 128, 16
LAYOUTS = {"bf16": "auto", "fp8": "fp8", "int4": "int4"}


def make_case(batch: int, ctx: int, kv: str, seed: int = 0):
    """Queries and a paged cache in ``kv``'s layout (random values, blocks in a random order)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = batch * -(-ctx // BS)
    table_ = torch.randperm(blocks, device="cuda", generator=g).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(blocks, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        if kv == "auto":
            caches.append(x)
            scales.append(None)
        elif kv == "int4":
            packed, groups = kvq.int4_quantize(x)
            caches.append(packed)
            scales.append(groups)
        else:
            s = torch.tensor([0.02], device="cuda")
            caches.append(kvq.fp8_quantize(x, s, kvq.FP8_DTYPES[kv]))
            scales.append(s)
        del x
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    return q, caches, scales, table_, seq_lens, cu


def case_bytes(batch: int, ctx: int, kv: str) -> int:
    per_token_head = kvq.bytes_per_token_head(kv, D, torch.bfloat16)
    return 2 * batch * ctx * HKV * per_token_head + 2 * batch * HQ * D * 2


def run(case, cfg: dict | None) -> tuple[float, float]:
    """(microseconds per call, relative error against the reference on the first two sequences)."""
    q, (kc, vc), (ks, vs), bt, sl, cu = case
    out = torch.empty_like(q)

    def call(_i: int = 0):
        pa.paged_attention_triton(q, kc, vc, bt, sl, cu, D**-0.5, 1, out=out, k_scale=ks, v_scale=vs,
                                  decode_config=cfg)

    call()
    ref = pa.paged_attention_torch(q[:2], kc, vc, bt[:2], sl[:2], cu[:3], D**-0.5, ks, vs)
    err = ((out[:2].double() - ref.double()).norm() / ref.double().norm()).item()
    return time_per_call(call, 4), err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few settings per layout")
    args = ap.parse_args()
    bw, _ = measure_ceilings()
    grid = list(itertools.product([32, 64, 128], [4, 8], [2, 3, 4]))
    if args.quick:
        grid = [(64, 4, 2), (128, 4, 3), (64, 8, 3)]
    print(header("Paged decode attention by KV layout and launch setting (8B attention, block size 16)"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
    rows, best = [], {}
    for name, kv in LAYOUTS.items():
        case = make_case(32, 8000, kv)
        nbytes = case_bytes(32, 8000, kv)
        default = pa.DECODE_CONFIGS[kvq.kv_mode(case[1][0])]
        results = []
        for block_n, warps, stages in grid:
            for waves in (4, 8):
                cfg = {**default, "block_n": block_n, "num_warps": warps, "num_stages": stages, "waves": waves}
                try:
                    us, err = run(case, cfg)
                except Exception as e:  # out of shared memory, say
                    print(f"{name} {cfg}: {type(e).__name__}", file=sys.stderr, flush=True)
                    continue
                results.append((us, cfg, err))
                print(f"{name} bn={block_n} w={warps} s={stages} waves={waves}: {us:.1f} us err {err:.1e}",
                      file=sys.stderr, flush=True)
        results.sort(key=lambda r: r[0])
        us_default, _ = run(case, default)
        for us, cfg, err in results[:4]:
            rows.append([name, "B=32 ctx=8000", f"bn={cfg['block_n']} w={cfg['num_warps']} s={cfg['num_stages']} "
                         f"waves={cfg['waves']}", f"{us:.1f}", f"{100 * nbytes / (us * 1e-6) / bw:.0f}%",
                         f"{us_default / us:.2f}x", f"{err:.1e}"])
        best[name] = [r[1] for r in results[:3]]
        del case
        torch.cuda.empty_cache()
    for name, kv in LAYOUTS.items():
        for batch, ctx in [(1, 32768), (128, 2048)]:
            case = make_case(batch, ctx, kv)
            nbytes = case_bytes(batch, ctx, kv)
            default = pa.DECODE_CONFIGS[kvq.kv_mode(case[1][0])]
            us_default, _ = run(case, default)
            for cfg in best[name]:
                us, err = run(case, cfg)
                rows.append([name, f"B={batch} ctx={ctx}", f"bn={cfg['block_n']} w={cfg['num_warps']} "
                             f"s={cfg['num_stages']} waves={cfg['waves']}", f"{us:.1f}",
                             f"{100 * nbytes / (us * 1e-6) / bw:.0f}%", f"{us_default / us:.2f}x", f"{err:.1e}"])
            del case
            torch.cuda.empty_cache()
    print(table(rows, ["KV", "case", "setting", "us", "% BW", "vs default", "rel err"]))
    print(f"\ndefaults: {pa.DECODE_CONFIGS}")


if __name__ == "__main__":
    main()
