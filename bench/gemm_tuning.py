"""The 8B shape's projections at the row counts of batched decode (64 to 512): cuBLAS as torch
picks it, cuBLASLt preferred, and the algorithm PyTorch's TunableOp picks after timing every one
cuBLAS / cuBLASLt offer for the shape (torch.cuda.tunable), in bf16 and in per-row FP8 W8A8
(torch._scaled_mm). Then the LM head: its bf16 logits converted to float32 (what the engine does)
against a product that writes float32 itself (torch.mm's out_dtype), where torch offers it.

At 256 rows the engine's GEMMs take about 1.5x their limit (docs/performance.md, "where a step
goes"); o and down give cuBLAS's 128-row tiles few output tiles to spread over the SMs. Each time
comes from a CUDA graph cycling through enough weight copies to overflow L2; limits in the same
run: weight bytes ÷ copy bandwidth, FLOPs ÷ the measured bf16 / FP8 matmul rates.

    python bench/gemm_tuning.py [--rows 64 128 256 512] [--tuning-ms 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from fp8_gemm import fp8_matmul_rate
from gemv_sweep import SHAPES, time_per_call

LM_HEAD = ("lm head", 128256, 4096)


def copies_for(n: int, k: int, elem: int) -> int:
    return max(2, -(-(200 << 20) // (n * k * elem)))  # > 200 MB of weights: none stays in L2


def gemms(x, x8, xs, w16, w8, ws, fp8: bool):
    if fp8:
        return lambda i: torch._scaled_mm(x8, w8[i].t(), scale_a=xs, scale_b=ws[i].view(1, -1), out_dtype=torch.bfloat16)
    return lambda i: F.linear(x, w16[i])


def time_shape(n: int, k: int, m: int, fp8: bool, tuned: bool) -> float:
    copies = copies_for(n, k, 1 if fp8 else 2)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w8 = ws = x8 = xs = None
    if fp8:
        ws = [w.float().abs().amax(1, keepdim=True) / 448 for w in w16]
        w8 = [(w.float() / s).to(torch.float8_e4m3fn) for w, s in zip(w16, ws)]
        xs = x.float().abs().amax(1, keepdim=True) / 448
        x8 = (x.float() / xs).to(torch.float8_e4m3fn)
        w16 = None
    fn = gemms(x, x8, xs, w16, w8, ws, fp8)
    torch.cuda.tunable.enable(tuned)
    torch.cuda.tunable.tuning_enable(tuned)
    try:
        return time_per_call(fn, copies)  # its warm-up calls, outside capture, do the tuning
    finally:
        torch.cuda.tunable.tuning_enable(False)
        torch.cuda.tunable.enable(False)


def fp8_tuned(n: int, k: int, m: int) -> float:
    try:
        return time_shape(n, k, m, fp8=True, tuned=True)
    except RuntimeError as exc:  # TunableOp without this scaling
        print(f"FP8 TunableOp, {n} x {k}, {m} rows: {exc}", file=sys.stderr)
        return float("inf")


def time_preferring_lt(n: int, k: int, m: int) -> float:
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return time_shape(n, k, m, fp8=False, tuned=False)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def lm_head_rows(m_list: list[int], bw: float, mm: float) -> list[list[str]]:
    _, n, k = LM_HEAD
    copies = copies_for(n, k, 2)
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    rows = []
    for m in m_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_now = time_per_call(lambda i: F.linear(x, w[i]).float(), copies)
        try:
            t_f32 = time_per_call(lambda i: torch.mm(x, w[i].t(), out_dtype=torch.float32), copies)
            err = ((torch.mm(x, w[0].t(), out_dtype=torch.float32) - x.float() @ w[0].float().t()).norm()
                   / (x.float() @ w[0].float().t()).norm()).item()
            f32 = f"{t_f32:.1f}", f"{err:.1e}"
        except (TypeError, RuntimeError) as exc:  # no out_dtype in this torch, or not for these types
            f32 = f"n/a ({type(exc).__name__})", ""
        limit = max(2 * n * k / bw * 2, 2 * m * n * k / mm) * 1e6
        rows.append([str(m), f"{t_now:.1f}", *f32, f"{limit:.1f}"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--tuning-ms", type=int, default=30, help="TunableOp's time budget per shape")
    args = ap.parse_args()
    bw, mm = measure_ceilings()  # before TunableOp is on: its 8192^3 product is cuBLAS's default
    mm8 = fp8_matmul_rate()
    tun = torch.cuda.tunable
    tun.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop.csv"))
    tun.set_max_tuning_duration(args.tuning_ms)
    tun.set_rotating_buffer_size(256)  # MB of operand copies cycled while tuning: timed out of L2, as in a step
    print(header("8B projections at batched-decode rows: cuBLAS's pick, cuBLASLt, TunableOp's pick"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, "
          f"FP8 matmul {mm8 / 1e12:.0f} TFLOP/s\n")
    rows = []
    for name, n, k in SHAPES[:4]:
        for m in args.rows:
            flops = 2 * m * n * k
            t = [time_shape(n, k, m, fp8=False, tuned=False), time_preferring_lt(n, k, m),
                 time_shape(n, k, m, fp8=False, tuned=True)]
            t8 = [time_shape(n, k, m, fp8=True, tuned=False), fp8_tuned(n, k, m)]
            limit = max(2 * n * k / bw * 2, flops / mm) * 1e6  # copy bandwidth counts read + write
            limit8 = max(n * k / bw * 2, flops / mm8) * 1e6
            rows.append([name, str(m), *(f"{v:.1f}" for v in t), f"{limit:.1f}", f"{limit / min(t):.0%}",
                         *(f"{v:.1f}" for v in t8), f"{limit8:.1f}", f"{limit8 / min(t8):.0%}"])
            torch.cuda.empty_cache()
    print(table(rows, ["weight", "rows", "bf16 cuBLAS µs", "cuBLASLt µs", "TunableOp µs", "bf16 limit µs",
                       "best of limit", "FP8 _scaled_mm µs", "FP8 TunableOp µs", "FP8 limit µs", "FP8 best of limit"]))
    print("\nTunableOp's picks:\n")
    print(table([[str(v) for v in r] for r in tun.get_results()], ["op", "shape", "algorithm", "ms"]))
    print("\nLM head (128256 x 4096), float32 logits:\n")
    print(table(lm_head_rows(args.rows, bw, mm),
                ["rows", "bf16 product + .float() µs", "mm(out_dtype=float32) µs", "rel err vs float32", "limit µs"]))


if __name__ == "__main__":
    main()
