"""NVFP4 routed experts at Qwen3-30B-A3B's sizes (128 experts of 768, hidden 2048, top 8) from 1
to 1024 tokens: kernels/nvfp4_moe.py (4-bit codes + a float32 scale per 16; the dispatch's path,
and the grouped GEMMs at one token) against the same experts as 8-bit integer codes with a
float16 scale per 16 (the layout NVFP4 experts had before) and 16-bit experts (fused_moe, the
reference). Each time is taken from a CUDA graph cycling through routings drawn apart, so the
chosen experts come from memory, not L2. The limit in the same run: the chosen experts' NVFP4
bytes ÷ copy bandwidth, or the FLOPs ÷ the measured bf16 matmul rate.

    python bench/nvfp4_moe.py [--tokens 1 4 16 64 256 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import fused_moe as fm
from kvship.kernels.nvfp4_moe import nvfp4_moe_triton

E, H, INTER, TOP_K = 128, 2048, 768, 8
ROUTINGS = 16  # per graph: 16 x 8 experts' NVFP4 bytes overflow L2 at one token


def stacks(g: torch.Generator):
    """The same random experts three ways: NVFP4 (codes [E, N, K/2], scales), 8-bit integer codes
    with float16 scales per 16, bfloat16; each (w13, w2, ExpertScales)."""
    def codes(n, k, per_byte):
        return torch.randint(0, 256, (E, n, k // per_byte), dtype=torch.uint8, generator=g, device="cuda")

    def scales(n, k, dtype):
        return (torch.rand(E, n, k // 16, generator=g, device="cuda") * 0.02 + 0.005).to(dtype)

    nv = (codes(2 * INTER, H, 2), codes(H, INTER, 2))
    nv_s = fm.ExpertScales(scales(2 * INTER, H, torch.float32), scales(H, INTER, torch.float32), 16, 16, None, None, 4, 4,
                           True)
    i8 = (codes(2 * INTER, H, 1), codes(H, INTER, 1))
    i8_s = fm.ExpertScales(scales(2 * INTER, H, torch.float16), scales(H, INTER, torch.float16), 16, 16, None, None, 8, 8)
    bf = [fm.expert_weight(w, nv_s, name, e, k, torch.bfloat16) for w, name, k in ((nv[0], "w13", H), (nv[1], "w2", INTER))
          for e in range(E)]
    bf16 = (torch.stack(bf[:E]), torch.stack(bf[E:]))
    return (*nv, nv_s), (*i8, i8_s), (*bf16, fm.NO_SCALES)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    args = ap.parse_args()
    bw, mm = measure_ceilings()
    g = torch.Generator(device="cuda").manual_seed(0)
    nv, i8, bf16 = stacks(g)
    per_expert = 3 * H * INTER * (0.5 + 4 / 16)  # NVFP4 codes and float32 scales, bytes
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
        routes = [fm.route(torch.randn(t, E, device="cuda", generator=g), TOP_K, True) for _ in range(ROUTINGS)]
        want = fm.fused_moe_torch(x.float(), bf16[0].float(), bf16[1].float(), *routes[0])
        got = nvfp4_moe_triton(x, *nv[:2], *routes[0], nv[2])
        err = ((got.float() - want).norm() / want.norm()).item()
        ours = time_per_call(lambda i: nvfp4_moe_triton(x, *nv[:2], *routes[i], nv[2]), ROUTINGS)
        grouped = time_per_call(lambda i: nvfp4_moe_triton(x, *nv[:2], *routes[i], nv[2],
                                                           config=fm.moe_config(t, TOP_K, E)), ROUTINGS)
        int8 = time_per_call(lambda i: fm.fused_moe_triton(x, *i8[:2], *routes[i], scales=i8[2]), ROUTINGS)
        ref = time_per_call(lambda i: fm.fused_moe_triton(x, *bf16[:2], *routes[i]), ROUTINGS)
        touched = sum(r[1].unique().numel() for r in routes) / ROUTINGS
        limit = max(touched * per_expert / bw, 2 * t * TOP_K * 3 * H * INTER / mm) * 1e6
        rows.append([str(t), f"{touched:.0f}", f"{ours:.1f}", f"{grouped:.1f}", f"{int8:.1f}", f"{ref:.1f}",
                     f"{limit:.1f}", f"{100 * limit / ours:.0f}%", f"{err:.1e}"])
    print(header("NVFP4 experts (kernels/nvfp4_moe.py) against 8-bit codes and bf16 (fused_moe)"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; {E} experts, hidden {H}, "
          f"intermediate {INTER}, top {TOP_K}; NVFP4 at 6 bits a weight, int8 at 9, bf16 at 16\n")
    print(table(rows, ["tokens", "experts read", "nvfp4 us", "nvfp4 grouped us", "int8 codes us", "bf16 us",
                       "limit us", "of limit", "rel. error vs fp32"]))


if __name__ == "__main__":
    main()
