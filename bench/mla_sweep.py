"""The latent-attention decode (kernels/mla_attention.py: the decode kernel and, split, its merge)
alone over a grid of launch settings, at DeepSeek-V2-Lite's and Moonlight's attention (16 heads,
latent rank 512 + rope key 64 in one cache row, block size 16): batch 1 at 512 / 4k / 32k tokens
and batch 32 at 4k. MLA_DECODE_CONFIG (kernels/tuning/attention.py) was written before any GPU ran it; the batch-1 profile of
Moonlight (2026-12-04) put the decode at about 8 us a layer and its merge at 1.9 us for a
512-token context, whose latent rows are 0.6 MB: the split count (64 there) makes every program
write, and the merge read, a [16, 512] float32 partial output, mostly of splits that hold no key.
Each setting is checked against the torch reference on the first two sequences, then timed from
a CUDA graph (CUDA events after warm-up, random pages). % BW = the cache rows read ÷ time ÷ copy
bandwidth measured in the same run.

    python bench/mla_sweep.py [--quick]
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
from kvship.kernels import mla_attention as mla

HEADS, RANK, ROPE, BS = 16, 512, 64, 16
CASES = [(1, 512), (1, 4096), (1, 32768), (32, 4096)]


def make_case(batch: int, ctx: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Queries [B, H, rank + rope] and a latent cache in random page order."""
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = batch * -(-ctx // BS)
    tables = torch.randperm(blocks, device=device, generator=g).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, HEADS, RANK + ROPE, device=device, dtype=dtype, generator=g)
    cache = torch.randn(blocks, BS, 1, RANK + ROPE, device=device, dtype=dtype, generator=g)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32)
    return q, cache, tables, seq_lens, cu


def run(case, cfg: dict, timed: bool = True) -> tuple[float, float]:
    """(microseconds per call, or 0 untimed; relative error against the reference on the first
    two sequences)."""
    q, cache, tables, seq_lens, cu = case
    out = torch.empty(*q.shape[:2], RANK, dtype=q.dtype, device=q.device)
    scale = (RANK + ROPE) ** -0.5

    def call(_i: int = 0):
        mla.mla_decode_triton(q, cache, tables, seq_lens, cu, scale, RANK, out, config=cfg)

    call()
    n = min(2, q.shape[0])
    ref = mla.mla_attention_torch(q[:n], cache, tables[:n], seq_lens[:n], cu[:n + 1], scale, RANK)
    err = ((out[:n].double() - ref.double()).norm() / ref.double().norm()).item()
    return (time_per_call(call, 4) if timed else 0.0), err


def settings(quick: bool) -> list[dict]:
    grid = itertools.product([16, 32, 64], [4, 8], [1, 2, 3], [2, 4], [8, 16, 32, 64])
    if quick:
        grid = itertools.product([32, 64], [4, 8], [2], [4], [8, 16, 64])
    return [{**mla.MLA_DECODE_CONFIG, "block_n": bn, "num_warps": w, "num_stages": s, "waves": waves,
             "max_splits": splits} for bn, w, s, waves, splits in grid]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few settings")
    args = ap.parse_args()
    bw, _ = measure_ceilings()
    grid = settings(args.quick)
    rows = []
    for batch, ctx in CASES:
        case = make_case(batch, ctx)
        nbytes = batch * ctx * (RANK + ROPE) * 2
        us_default, _ = run(case, mla.MLA_DECODE_CONFIG)
        results = []
        for cfg in grid:
            try:
                us, err = run(case, cfg)
            except Exception as e:  # out of shared memory or registers, say
                print(f"B={batch} ctx={ctx} {name(cfg)}: {type(e).__name__}", file=sys.stderr, flush=True)
                continue
            if err > 2e-2:
                print(f"B={batch} ctx={ctx} {name(cfg)}: rel err {err:.1e}, left out", file=sys.stderr, flush=True)
                continue
            results.append((us, cfg, err))
        results.sort(key=lambda r: r[0])
        pct = lambda us: f"{100 * nbytes / (us * 1e-6) / bw:.0f}%"
        rows.append([f"B={batch} ctx={ctx}", "default " + name(mla.MLA_DECODE_CONFIG), f"{us_default:.1f}",
                     pct(us_default), "1.00x", "-"])
        for us, cfg, err in results[:3]:
            rows.append([f"B={batch} ctx={ctx}", name(cfg), f"{us:.1f}", pct(us), f"{us_default / us:.2f}x",
                         f"{err:.1e}"])
        del case
        torch.cuda.empty_cache()
    print(header(f"Latent-attention decode by launch setting ({HEADS} heads, rank {RANK} + rope {ROPE}, "
                 f"block size {BS}), the merge included"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
    print(table(rows, ["case", "setting", "us", "% BW", "vs default", "rel err"]))


def name(cfg: dict) -> str:
    return (f"bn={cfg['block_n']} w={cfg['num_warps']} s={cfg['num_stages']} waves={cfg['waves']} "
            f"splits<={cfg['max_splits']}")


if __name__ == "__main__":
    main()
