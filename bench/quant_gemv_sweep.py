"""Quantized one-row GEMV (batch-1 decode) on the 8B shape's projections: the kernels of
kernels/quant_gemv.py (the fp16-pair one and the word-reading one; for FP8 also quant_linear.py's
per-code one) over a grid of launch settings per weight format, against cuBLAS on the bf16 matrix
and the engine's current one-row kernel ("engine"), each timed from a CUDA graph cycling through
enough weight copies to overflow L2.
% BW = the format's real bytes (codes, scales, offsets) ÷ time ÷ measured copy bandwidth.
Also the dequantizing GEMM at 16 and 256 rows against cuBLAS bf16, and with --tokens the small
batches: 4-bit weights through the tensor-core kernel, FP8 ones through the dequantizing GEMM
against W8A8 (per-token FP8 activations and cuBLAS's FP8 GEMM, the path from DENSE_ROWS rows).

    python bench/quant_gemv_sweep.py [--quick] [--tokens 2 4 8]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import SHAPES, time_per_call
from kvship.kernels.quant_gemv import fits, pairs_fit
from kvship.kernels.quant_gemv_mma import mma_fit
from kvship.kernels.quant_linear import (
    _dense_matmul,
    _gemm_config,
    pack,
    quant_linear_torch,
    quant_linear_triton,
    shape_key,
)
from kvship.quant import quantize
from kvship.quant.insitu import quantize_groups

FORMATS = {"fp8": lambda w: quantize(w, "fp8"), "int8": lambda w: quantize(w, "int8"),
           "int4 g128": lambda w: quantize(w, "int4"), "int4 g32": lambda w: quantize_groups(w, 4, 32)}


KERNELS = ("word", "pairs", "mma", "per-code")


def one_row(x, qw, cfg):
    """The kernel a setting names: "pairs", "block_w" (word-reading) or else the per-code one."""
    return quant_linear_triton(x, qw, None, cfg)


def kernel_of(cfg) -> str:
    if "mma" in cfg:
        return "mma kernel"
    return "pairs kernel" if "pairs" in cfg else "word kernel" if "block_w" in cfg else "per-code kernel"


def takes(qw, cfg) -> bool:
    if "mma" in cfg:
        return mma_fit(qw.bits, qw.k, qw.group_size, qw.scales.shape[1], qw.g_idx is not None, torch.bfloat16)
    if "pairs" in cfg:
        return pairs_fit(qw.bits, qw.k, qw.group_size, qw.scales.shape[1], False)
    if "block_w" in cfg:
        return fits(qw.bits, qw.k, qw.group_size, qw.scales.shape[1], False, cfg["block_w"])
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
                    help="which one-row kernels' grids to sweep (the engine's own setting is timed always)")
    ap.add_argument("--all", action="store_true", help="also a table of every setting's time")
    ap.add_argument("--best-json", help="write each kernel's best setting per weight (quant_linear.shape_key) here, "
                                        "for bench/latency.py --settings")
    ap.add_argument("--tokens", nargs="*", type=int, default=[],
                    help="small batches: the tensor-core kernel's settings at these row counts (4-bit, groups of 128) "
                         "against the dequantizing GEMM and cuBLAS bf16; FP8: the dequantizing GEMM against W8A8")
    args = ap.parse_args()
    copy_bw, mm = measure_ceilings()
    grid = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            for bn, bk, nw, ns in itertools.product([8, 16, 32], [128, 256, 512], [4, 8], [2, 3])]
    # the word-reading kernel (kernels/quant_gemv.py): block_w words per row and tile
    words = [dict(block_n=bn, block_w=bw, num_warps=nw, num_stages=ns) for bn, bw, nw, ns in
             itertools.product([2, 4, 8, 16], [128, 256, 512], [4, 8], [2, 3])]
    # the fp16-pair kernel (16-bit x: integer and FP8 codes)
    pairs = [dict(pairs=1, block_n=bn, block_w=bw, num_warps=nw, num_stages=ns) for bn, bw, nw, ns in
             itertools.product([8, 16, 32, 64], [64, 128, 256, 512], [2, 4, 8], [3])
             if 8 <= bn * bw // (32 * nw) <= 64]  # words a thread holds
    # the tensor-core kernel (kernels/quant_gemv_mma.py): 4-bit codes in groups of 128
    mmas = [dict(mma=1, rows=rows, num_warps=nw) for rows in (16, 32) for nw in (2, 4, 8)]
    if args.quick:
        pairs = [c for c in pairs if (c["block_n"], c["block_w"], c["num_warps"]) in
                 ((8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 128, 4), (32, 128, 4), (8, 256, 2))]
        grid = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in
                ((16, 256, 4, 3), (8, 256, 4, 3), (32, 128, 4, 3), (16, 512, 8, 3), (8, 512, 4, 2), (32, 256, 8, 3))]
        words = [dict(block_n=bn, block_w=bw, num_warps=nw, num_stages=3) for bn, bw, nw in
                 ((4, 256, 4), (8, 256, 8), (16, 256, 8), (2, 512, 4), (4, 512, 8), (8, 128, 4))]
    rows, gemm_rows, kind_rows, all_rows, token_rows, fp8_rows = [], [], [], [], [], []
    best_settings = []  # [shape_key, setting]: one-row pairs kernel, and the mma kernel at the most tokens
    for name, n, k in SHAPES[:4]:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        copies16 = max(4, -(-300_000_000 // (n * k * 2)))
        ws16 = [w16.clone() for _ in range(copies16)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cublas = time_per_call(lambda i: torch.nn.functional.linear(x, ws16[i]), copies16)
        ws16 = None

        def cublas_rows(xm):  # cuBLAS bf16 on xm's rows, the weights streamed as above
            ws = [w16.clone() for _ in range(copies16)]
            return time_per_call(lambda i: torch.nn.functional.linear(xm, ws[i]), copies16)

        for fmt in args.formats:
            make = FORMATS[fmt]
            qw = pack(make(w16.float()), "cuda")
            nbytes = qw.nbytes()
            copies = max(4, -(-300_000_000 // nbytes))
            qws = [qw] + [pack(make(w16.float()), "cuda") for _ in range(copies - 1)]
            ref = quant_linear_torch(x.float(), qw)
            best, best_of = None, {}
            grids = {"word": words, "pairs": pairs, "mma": mmas, "per-code": grid if qw.fp8 else []}
            for cfg in [c for kind in args.kernels for c in grids[kind]]:
                if not takes(qw, cfg):
                    continue
                try:
                    out = one_row(x, qw, cfg).float()
                    err = ((out - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        print(f"  {name} {fmt} {cfg}: rel err {err:.1e}, skipped", file=sys.stderr)
                        continue
                    us = time_per_call(lambda i: one_row(x, qws[i], cfg), copies)
                except Exception as e:  # out of resources for this setting
                    print(f"  {name} {fmt} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                    continue
                all_rows.append([name, fmt, kernel_of(cfg), f"{us:.1f}", f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}%",
                                 str(cfg)])
                if best is None or us < best[0]:
                    best = (us, cfg)
                kind = kernel_of(cfg)
                if kind not in best_of or us < best_of[kind][0]:
                    best_of[kind] = (us, cfg)
            engine = time_per_call(lambda i: quant_linear_triton(x, qws[i]), copies)  # its own settings
            bw = lambda us: f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}%"
            if best:
                rows.append([name, f"{n}x{k}", fmt, f"{nbytes / 1e6:.1f}", f"{cublas:.1f}", f"{engine:.1f}", bw(engine),
                             f"{best[0]:.1f}", bw(best[0]), f"{cublas / min(engine, best[0]):.2f}x", str(best[1])])
                for kind, (us, cfg) in best_of.items():
                    kind_rows.append([name, fmt, kind, f"{us:.1f}", bw(us), str(cfg)])
                if "pairs kernel" in best_of:
                    best_settings.append([list(shape_key(qw)), best_of["pairs kernel"][1]])
            for m in args.tokens if qw.fp8 else []:
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = quant_linear_torch(xm.float(), qw)
                got = _dense_matmul(xm, qw, None).float()
                tgemm = time_per_call(lambda i: quant_linear_triton(xm, qws[i], None, _gemm_config(m)), copies)
                tw8a8 = time_per_call(lambda i: _dense_matmul(xm, qws[i], None), copies)
                fp8_rows.append([name, str(m), f"{cublas_rows(xm):.1f}", f"{tgemm:.1f}", bw(tgemm), f"{tw8a8:.1f}",
                                 bw(tw8a8), f"{((got - want).norm() / want.norm()).item():.1e}",
                                 f"{tgemm / tw8a8:.2f}x"])
            for m in args.tokens if qw.bits == 4 and not qw.fp8 else []:
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t16 = cublas_rows(xm)
                tgemm = time_per_call(lambda i: quant_linear_triton(xm, qws[i], None, _gemm_config(m)), copies)
                tengine = time_per_call(lambda i: quant_linear_triton(xm, qws[i]), copies)
                mma_best = None
                for cfg in mmas if takes(qw, mmas[0]) else []:
                    out = quant_linear_triton(xm, qw, None, cfg).float()
                    want = quant_linear_torch(xm.float(), qw)
                    if ((out - want).norm() / want.norm()).item() > 2e-2:
                        print(f"  {name} {fmt} {m} tokens {cfg}: wrong, skipped", file=sys.stderr)
                        continue
                    us = time_per_call(lambda i: quant_linear_triton(xm, qws[i], None, cfg), copies)
                    if mma_best is None or us < mma_best[0]:
                        mma_best = (us, cfg)
                if mma_best and m == max(args.tokens):
                    best_settings.append([list(shape_key(qw)), mma_best[1]])
                if mma_best:
                    token_rows.append([name, fmt, str(m), f"{t16:.1f}", f"{tgemm:.1f}", f"{tengine:.1f}", bw(tengine),
                                       f"{mma_best[0]:.1f}", bw(mma_best[0]), f"{tgemm / tengine:.2f}x",
                                       str(mma_best[1])])
            for m in (16, 256):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t16 = time_per_call(lambda i: torch.nn.functional.linear(xm, w16), 4)
                tq = time_per_call(lambda i: quant_linear_triton(xm, qws[i % len(qws)], None, _gemm_config(m)), 4)
                gemm_rows.append([name, fmt, str(m), f"{t16:.1f}", f"{tq:.1f}", f"{t16 / tq:.2f}x"])
            qws = qw = None
            torch.cuda.empty_cache()
    print(header("Quantized one-row GEMV: Triton per format vs cuBLAS bf16, weights streamed from HBM"))
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s\n")
    print(table(rows, ["weight", "N x K", "format", "MB", "cuBLAS bf16 µs", "engine µs", "engine % BW",
                       "grid best µs", "grid % BW", "speed-up", "grid best setting"]))
    print()
    print(table(kind_rows, ["weight", "format", "best on", "µs", "% BW", "setting"]))
    print()
    print(table(gemm_rows, ["weight", "format", "rows", "cuBLAS bf16 µs", "dequant GEMM µs", "speed-up"]))
    if token_rows:
        print()
        print(table(token_rows, ["weight", "format", "tokens", "cuBLAS bf16 µs", "dequant GEMM µs", "engine µs",
                                 "engine % BW", "mma best µs", "mma % BW", "engine vs GEMM", "mma best setting"]))
    if fp8_rows:
        print()
        print(table(fp8_rows, ["weight", "tokens", "cuBLAS bf16 µs", "dequant GEMM µs", "GEMM % BW", "W8A8 µs",
                               "W8A8 % BW", "W8A8 rel err", "GEMM / W8A8"]))
    if args.best_json:
        Path(args.best_json).write_text(json.dumps(best_settings))
    if args.all:
        print()
        print(table(all_rows, ["weight", "format", "kernel", "µs", "% BW", "setting"]))


if __name__ == "__main__":
    main()
