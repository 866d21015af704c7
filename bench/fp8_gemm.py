"""Block-wise FP8 weights (a scale per 128 x 128 block, as Qwen3-FP8 and DeepSeek-V3 ship) at 2 to
4096 rows, on the 8B shape's projections: what the engine ran before (the matrix expanded to bf16,
then cuBLAS; below 16 rows the dequantizing GEMM) against W8A8 through kernels/fp8_matmul.py
(activations quantized per token and group of 128, the group GEMM), beside per-row FP8 W8A8
(torch._scaled_mm) and cuBLAS bf16 on the 16-bit matrix, and what the engine runs now (the group
GEMM up to GROUP_GEMM_ROWS rows, the bf16 expansion beyond). Each time includes the activations'
quantization; each is taken from a CUDA graph cycling through enough weight copies to overflow
L2. Limits in the same run: the FP8 bytes ÷ copy bandwidth, the FLOPs ÷ the measured FP8 and bf16
matmul rates. With --sweep, every group-GEMM setting of a small grid, and the best per row count.

    python bench/fp8_gemm.py [--rows 2 16 64 256 1024 4096] [--sweep]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import _time_cuda, header, measure_ceilings, table
from gemv_sweep import SHAPES, time_per_call
from kvship.kernels.fp8_matmul import (
    fp8_group_matmul_triton,
    group_gemm_config,
    quantize_fp8_groups,
)
from kvship.kernels.quant_linear import _dense_matmul, _gemm_config, dequantize_triton, pack, quant_linear_triton
from kvship.quant import quantize
from kvship.quant.insitu import quantize_fp8_blocks


def fp8_matmul_rate() -> float:
    """FP8 tensor-core FLOP/s: torch._scaled_mm on 8192^3 random codes, per-row scales."""
    m = 8192
    a = (torch.randn(m, m, device="cuda") * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(m, m, device="cuda") * 8).to(torch.float8_e4m3fn)
    s = torch.ones(m, 1, device="cuda")
    return 2 * m**3 / _time_cuda(lambda: torch._scaled_mm(a, b.t(), scale_a=s, scale_b=s.view(1, -1),
                                                          out_dtype=torch.bfloat16))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16, 64, 256, 1024, 4096])
    ap.add_argument("--sweep", action="store_true", help="every group-GEMM setting of a small grid")
    args = ap.parse_args()
    bw, mm = measure_ceilings()
    mm8 = fp8_matmul_rate()
    print(header("Block-wise FP8 weights, 8B projections: bf16 expansion against the group GEMM"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, "
          f"FP8 matmul {mm8 / 1e12:.0f} TFLOP/s\n")
    rows, sweep_rows = [], []
    for name, n, k in SHAPES[:4]:
        copies = max(2, -(-(200 << 20) // (n * k)))  # > 200 MB of FP8 weights: none stays in L2
        w16 = [torch.randn(n, k, device="cuda") * 0.05 for _ in range(copies)]
        block = [pack(quantize_fp8_blocks(w, 128), "cuda") for w in w16]
        per_row = [pack(quantize(w, "fp8"), "cuda") for w in w16]
        w16 = [w.to(torch.bfloat16) for w in w16]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), dequantize_triton(block[0], torch.float32))
            got = quant_linear_triton(x, block[0]).float()
            err = ((got - ref).norm() / ref.norm()).item()
            # before: below 16 rows the dequantizing GEMM (quant_linear_triton with its own setting), else
            # the matrix expanded to bf16 for cuBLAS
            old = (lambda i: quant_linear_triton(x, block[i], config=_gemm_config(m))) if m < 16 else \
                (lambda i: F.linear(x, dequantize_triton(block[i], x.dtype)))
            t_old = time_per_call(old, copies)
            t_new = time_per_call(lambda i: fp8_group_matmul_triton(*quantize_fp8_groups(x, 128), block[i].qweight,
                                                                    block[i].scales, 128, None, x.dtype), copies)
            t_engine = time_per_call(lambda i: _dense_matmul(x, block[i], None), copies)
            t_row = time_per_call(lambda i: _dense_matmul(x, per_row[i], None), copies)
            t_16 = time_per_call(lambda i: F.linear(x, w16[i]), copies)
            flops = 2 * m * n * k
            limit = max(n * k / bw * 2, flops / mm8) * 1e6  # copy bandwidth counts read + write
            rows.append([name, m, f"{t_old:.1f}", f"{t_new:.1f}", f"{t_old / t_new:.2f}x", f"{t_engine:.1f}", f"{t_row:.1f}",
                         f"{t_16:.1f}", f"{limit:.1f}", f"{flops / t_new / 1e6:.0f}", f"{err:.1e}"])
            if args.sweep:
                xq, xs = quantize_fp8_groups(x, 128)
                best = None
                for bm, bn, nw, ns, gm in itertools.product([16, 64, 128], [64, 128], [4, 8], [3, 4], [8]):
                    if bm > max(16, 4 * m) or (bm == 16 and nw == 8):
                        continue
                    cfg = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, group_m=gm)
                    try:
                        t = time_per_call(lambda i: fp8_group_matmul_triton(xq, xs, block[i].qweight, block[i].scales,
                                                                            128, None, x.dtype, cfg), copies)
                    except Exception:  # out of shared memory for this setting
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                engine = group_gemm_config(m, n, k)
                t_engine = time_per_call(lambda i: fp8_group_matmul_triton(xq, xs, block[i].qweight, block[i].scales,
                                                                           128, None, x.dtype, engine), copies)
                sweep_rows.append([name, m, f"{t_engine:.1f}", f"{best[0]:.1f}", str(best[1])])
        w16 = block = per_row = None
        torch.cuda.empty_cache()
    print(table(rows, ["weight", "rows", "bf16 expansion µs (< 16 rows: dequantizing GEMM)", "group GEMM µs (with "
                       "activation quantization)", "speed-up", "engine µs", "per-row FP8 W8A8 µs", "cuBLAS bf16 µs", "limit µs",
                       "group GEMM TFLOP/s", "rel err vs dequantized"]))
    if sweep_rows:
        print("\nGroup GEMM alone (activations already quantized), engine setting against the grid's best:\n")
        print(table(sweep_rows, ["weight", "rows", "engine µs", "best µs", "best setting"]))


if __name__ == "__main__":
    main()
