"""One-row GEMV on the tensor cores with its weight tiles streamed through shared memory: a probe.

The engine's one-row kernels (kernels/gemv.py for 16-bit weights, kernels/quant_gemv.py's pairs
kernel for FP8) load their weight tiles into registers (sm_90 SASS: LDG, 216 registers a thread
for the 16-bit kernel), which bounds the bytes an SM keeps in flight, and they reach 72-97% of
copy bandwidth, while the decode attention, whose tiles Triton streams through shared memory with
cp.async (LDGSTS), reads KV at 4.94 TB/s, above the copy rate (4.25, read + write). Here the
weight tile is a tl.dot operand, x the other one (row 0 of a 16-row tile, the rest zeros), so
Triton pipelines the weight loads through shared memory over num_stages buffers and the products
run as mma.sync. FP8 weights are converted to fp16 between shared memory and the dot, and x is
taken in fp16 there, as the pairs kernel does. Each setting is checked against F.linear, then
timed from a CUDA graph cycling through enough weight copies to overflow L2
(gemv_sweep.time_per_call), beside cuBLAS and the engine's kernel at its own setting.

    python bench/tc_gemv_sweep.py [--quick] [--formats bf16,fp8]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import gemv
from kvship.kernels.quant_linear import pack, quant_linear_triton
from kvship.quant import quantize

SHAPES = [("8b qkv", 6144, 4096), ("8b o", 4096, 4096), ("8b gate_up", 28672, 4096), ("8b down", 4096, 14336),
          ("8b lm_head", 128256, 4096), ("a3b qkv", 5120, 2048), ("a3b o", 2048, 4096)]


@triton.jit
def _tc_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_w, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, 16)
    nmask = offs_n < N
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        w = tl.load(rows + kk[None, :], mask=nmask[:, None], other=0, eviction_policy="evict_first")
        x = tl.load(x_ptr + kk, eviction_policy="evict_last")
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        xb = tl.where(r[:, None] == 0, x[None, :], 0.0).to(w.dtype)
        acc = tl.dot(xb, tl.trans(w), acc)
    y = tl.sum(acc, 0)
    if FP8:
        y = y * tl.load(s_ptr + offs_n, mask=nmask, other=0.0)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)


def tc_gemv(x, w, scales, cfg):
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    fp8 = w.dtype == torch.float8_e4m3fn
    _tc_gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, w.view(torch.uint8) if fp8 else w, scales if fp8 else x, y, n, k, w.stride(0), FP8=fp8,
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--formats", default="bf16,fp8")
    args = ap.parse_args()
    copy_bw, _ = measure_ceilings()
    grid = list(itertools.product([16, 32, 64], [128, 256, 512], [2, 4], [3, 4, 6]))
    if args.quick:
        grid = list(itertools.product([16, 32], [256, 512], [4], [3, 4]))
    rows = []
    for fmt in args.formats.split(","):
        for name, n, k in SHAPES:
            elem = 2 if fmt == "bf16" else 1
            copies = max(2, -(-300_000_000 // (n * k * elem)))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            if fmt == "fp8":
                qws = [pack(quantize(w, "fp8"), "cuda") for w in dense]
                ws = [q.qweight for q in qws]
                ss = [q.scales.reshape(-1).float().contiguous() for q in qws]
                ref = F.linear(x.float(), ws[0].float() * ss[0][:, None]).to(torch.bfloat16)
                engine = lambda i: quant_linear_triton(x, qws[i])  # noqa: E731
            else:
                ws, ss = dense, [None] * copies
                ref = F.linear(x, ws[0])
                cfg0 = gemv.GEMV_SHAPES.get((n, k), gemv.DEFAULT_CONFIG)
                engine = lambda i: gemv.gemv_triton(x, ws[i], None, cfg0)  # noqa: E731
            dense = None
            torch.cuda.empty_cache()
            cublas = time_per_call(lambda i: F.linear(x, ws[i]), copies) if fmt == "bf16" else float("nan")
            eng = time_per_call(engine, copies)
            best = None
            for bn, bk, nw, ns in grid:
                cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                if k % bk:
                    continue
                try:
                    out = tc_gemv(x, ws[0], ss[0], cfg)
                    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                    if err > 2e-2:
                        print(f"  {fmt} {name} {cfg}: rel err {err:.1e}", file=sys.stderr, flush=True)
                        continue
                    us = time_per_call(lambda i: tc_gemv(x, ws[i], ss[i], cfg), copies)
                except Exception as e:  # out of shared memory
                    print(f"  {fmt} {name} {cfg}: {type(e).__name__}", file=sys.stderr, flush=True)
                    continue
                print(f"  {fmt} {name} {cfg}: {us:.1f} us", file=sys.stderr, flush=True)
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            nbytes = n * k * elem
            pct = lambda us: f"{100 * nbytes / (us * 1e-6) / copy_bw:.0f}%"  # noqa: E731
            rows.append([fmt, name, f"{n}x{k}", f"{cublas:.1f}", f"{eng:.1f} ({pct(eng)})",
                         f"{best[0]:.1f} ({pct(best[0])})" if best else "-", str(best[1]) if best else "-",
                         f"{best[2]:.0e}" if best else "-"])
            ws = ss = qws = None
            torch.cuda.empty_cache()
    print(header("One-row GEMV: the engine's kernel against a tensor-core GEMV streaming weights via shared memory"))
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; % = weight bytes / time / that\n")
    print(table(rows, ["format", "weight", "N x K", "cuBLAS µs", "engine kernel µs", "tensor-core µs", "best setting",
                       "rel err"]))


if __name__ == "__main__":
    main()
