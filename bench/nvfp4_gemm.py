"""NVFP4 weights (e2m1 codes two a byte, a float32 scale per 16 inputs as kvship holds them) on the
8B shape's projections at 1 to 256 rows: kernels/nvfp4_linear.py's W4A16 kernel against cuBLAS
bf16 on the 16-bit matrix (the reference) and the matrix dequantized then cuBLAS. Each time is
taken from a CUDA graph cycling through enough weight copies to overflow L2. Limits in the same
run: the NVFP4 bytes (codes + scales) ÷ copy bandwidth, the FLOPs ÷ the measured bf16 matmul rate.

    python bench/nvfp4_gemm.py [--rows 1 4 16 64 256]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import SHAPES, time_per_call
from kvship.kernels.nvfp4_linear import dequantize_nvfp4_torch, nvfp4_linear_triton
from kvship.kernels.quant_linear import pack
from kvship.quant.nvfp4 import nvfp4


def random_nvfp4(n: int, k: int, g: torch.Generator):
    """A packed NVFP4 matrix of random codes with absmax-like scales, and its bf16 twin."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g, device="cuda")
    scale = (torch.rand(n, k // 16, generator=g, device="cuda") * 2 + 0.5).to(torch.float8_e4m3fn)
    w = pack(nvfp4({"weight_packed": packed, "weight_scale": scale,
                    "weight_global_scale": torch.tensor([100.0], device="cuda")}), "cuda")
    return w, dequantize_nvfp4_torch(w.qweight, w.scales, k).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    args = ap.parse_args()
    bw, mm = measure_ceilings()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k in SHAPES[:4]:
        w, dense = random_nvfp4(n, k, g)
        nbytes = w.qweight.numel() + w.scales.numel() * 4
        copies = max(2, (256 << 20) // nbytes)  # overflow L2 with distinct weights
        ws = [w] + [random_nvfp4(n, k, g)[0] for _ in range(copies - 1)]
        denses = [dense] + [dense.clone() for _ in range(copies - 1)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            got = nvfp4_linear_triton(x, w.qweight, w.scales, k)
            err = ((got.float() - F.linear(x, dense).float()).norm() / F.linear(x, dense).float().norm()).item()
            ours = time_per_call(lambda i: nvfp4_linear_triton(x, ws[i].qweight, ws[i].scales, k), copies)
            ref = time_per_call(lambda i: F.linear(x, denses[i]), copies)
            expand = time_per_call(lambda i: F.linear(x, dequantize_nvfp4_torch(ws[i].qweight, ws[i].scales, k)
                                                      .to(torch.bfloat16)), min(copies, 8))
            limit = max((nbytes + 2 * m * (n + k)) / bw, 2 * m * n * k / mm) * 1e6
            rows.append([name, f"{n}x{k}", str(m), f"{ours:.1f}", f"{ref:.1f}", f"{expand:.1f}", f"{limit:.1f}",
                         f"{100 * limit / ours:.0f}%", f"{err:.1e}"])
    print(header("NVFP4 W4A16 (kernels/nvfp4_linear.py) against cuBLAS bf16"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; NVFP4 held as 4-bit codes + a "
          "float32 scale per 16 (6 bits a weight)\n")
    print(table(rows, ["matrix", "N x K", "rows", "nvfp4 us", "cuBLAS bf16 us", "dequantize + cuBLAS us",
                       "limit us", "of limit", "rel. error vs bf16"]))


if __name__ == "__main__":
    main()
