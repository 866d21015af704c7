"""The 8B shape's projections at the row counts of batched decode (64 to 512): cuBLAS as torch
picks it, cuBLASLt preferred, and the algorithm PyTorch's TunableOp picks after timing every one
cuBLAS / cuBLASLt offer for the shape (torch.cuda.tunable), in bf16 and in per-row FP8 W8A8
(torch._scaled_mm). With --triton, a split-K Triton GEMM candidate (below) over a small grid of
settings, checked against torch first, its best setting per shape and row count. Then the LM
head: its bf16 logits converted to float32 (what the engine does) against a product that writes
float32 itself (torch.mm's out_dtype), where torch offers it.

At 256 rows the engine's GEMMs take about 1.5x their limit (docs/performance.md, "where a step
goes"); o and down give cuBLAS's 128-row tiles few output tiles to spread over the SMs. Each time
comes from a CUDA graph cycling through enough weight copies to overflow L2; limits in the same
run: weight bytes ÷ copy bandwidth, FLOPs ÷ the measured bf16 / FP8 matmul rates.

    python bench/gemm_tuning.py [--rows 64 128 256 512] [--tuning-ms 30] [--triton [--triton-rows 256]]
"""
from __future__ import annotations

import argparse
import itertools
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
from kvship.kernels._triton import tl, triton
from kvship.kernels.fp8_matmul import grouped_tile

LM_HEAD = ("lm head", 128256, 4096)


@triton.jit
def _split_k_gemm(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = A @ W^T for A [M, K], W [N, K]: a tile of C per program of axis 0 (fp8_matmul's
    grouped_tile), its K range split over axis 1; with SPLIT_K > 1 the partial
    tiles are added into a float32 C. K must divide into SPLIT_K * BLOCK_K pieces."""
    offs_m, offs_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    k_len = K // SPLIT_K
    k_start = tl.program_id(1) * k_len
    a = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_start + offs_k)[None, :]
    w = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        acc = tl.dot(tl.load(a, mask=mmask[:, None], other=0.0), tl.trans(tl.load(w, mask=nmask[:, None], other=0.0)),
                     acc)
        a += BLOCK_K
        w += BLOCK_K
    c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    cmask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.atomic_add(c, acc, mask=cmask, sem="relaxed")


def split_k_linear(x: torch.Tensor, w: torch.Tensor, cfg: dict) -> torch.Tensor:
    """F.linear(x, w) (no bias) through _split_k_gemm; with split_k > 1 a float32 sum, then bf16."""
    m, k = x.shape
    n = w.shape[0]
    split = cfg["split_k"]
    assert k % (split * cfg["block_k"]) == 0
    out = torch.empty(m, n, device=x.device, dtype=x.dtype) if split == 1 else \
        torch.zeros(m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]), split)
    _split_k_gemm[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=cfg["block_m"],
                        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SPLIT_K=split, GROUP_M=8,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out if split == 1 else out.to(x.dtype)


def triton_grid() -> list[dict]:
    grid = []
    for bm, bn, split, warps, stages in itertools.product([64, 128], [128, 256], [1, 2, 4], [4, 8], [3, 4]):
        if bm * bn > 128 * 128 and warps == 4:  # the accumulator alone would take 256 registers a thread
            continue
        grid.append(dict(block_m=bm, block_n=bn, block_k=64, split_k=split, num_warps=warps, num_stages=stages))
    return grid


def triton_rows(rows: list[int], bw: float, mm: float) -> list[list[str]]:
    """Per shape and row count: cuBLAS, then the grid's best setting of the split-K candidate."""
    out = []
    for name, n, k in SHAPES[:4]:
        copies = copies_for(n, k, 2)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), w16[0].float())
            t_cublas = time_per_call(lambda i: F.linear(x, w16[i]), copies)
            best = None
            for cfg in triton_grid():
                if k % (cfg["split_k"] * cfg["block_k"]):
                    continue
                try:
                    err = ((split_k_linear(x, w16[0], cfg).float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, f"{cfg}: relative error {err:.1e}"
                    t = time_per_call(lambda i: split_k_linear(x, w16[i], cfg), copies)
                except triton.runtime.errors.OutOfResources:
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            limit = max(2 * n * k / bw * 2, 2 * m * n * k / mm) * 1e6
            out.append([name, str(m), f"{t_cublas:.1f}", f"{best[0]:.1f}", f"{limit:.1f}", f"{limit / t_cublas:.0%}",
                        f"{limit / best[0]:.0%}", f"{best[2]:.1e}", str(best[1])])
        w16 = None
        torch.cuda.empty_cache()
    return out


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
    ap.add_argument("--triton", action="store_true", help="also the split-K Triton candidate's grid")
    ap.add_argument("--triton-rows", type=int, nargs="+", default=[256])
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
    if args.triton:
        print("\nSplit-K Triton GEMM candidate, the best of its grid, against cuBLAS:\n")
        print(table(triton_rows(args.triton_rows, bw, mm),
                    ["weight", "rows", "cuBLAS µs", "Triton best µs", "limit µs", "cuBLAS of limit",
                     "Triton of limit", "rel err", "setting"]))
    print("\nLM head (128256 x 4096), float32 logits:\n")
    print(table(lm_head_rows(args.rows, bw, mm),
                ["rows", "bf16 product + .float() µs", "mm(out_dtype=float32) µs", "rel err vs float32", "limit µs"]))


if __name__ == "__main__":
    main()
