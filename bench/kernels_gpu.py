"""GPU benchmark of the Triton kernels (engine/kvship/kernels) at Llama-3-8B sizes, bf16.

Every case first checks the kernel against its torch reference on fresh random data, then
times it with triton.testing.do_bench (median, after warm-up) and reports achieved GB/s
(bytes each kernel must move at least) against a device-to-device copy measured in the same
run, and for prefill TFLOP/s against a bf16 matmul measured in the same run. Attention also
gets torch's scaled_dot_product_attention over a contiguous (unpaged) copy of the same K/V as
a point of comparison.

    python bench/kernels_gpu.py [--sweep] [--out table.md]

--sweep additionally times a few launch configurations of the attention kernels.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from kvship.kernels import activation, norm, rotary
from kvship.kernels import paged_attention as pa

DEV = "cuda"
DT = torch.bfloat16
HQ, HKV, D, BS = 32, 8, 128, 16  # Llama-3-8B attention, block size 16
HIDDEN, INTER = 4096, 14336

ROWS: list[str] = []


GRAPH = True


def bench(fn, graph: bool = True) -> float:
    """Median milliseconds of the GPU work: replayed from a CUDA graph (as the engine runs
    decode), so Python launch overhead stays out; plain do_bench for code that cannot be
    captured (host syncs) or with --no-graph."""
    if GRAPH and graph:
        try:
            return do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as e:
            print(f"  (graph timing failed, {type(e).__name__}; timing eagerly)")
            torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(out, ref) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def row(name, ms, gbytes=None, copy_bw=None, tflop=None, mm_rate=None, err=None, ref_ms=None):
    gbs = gbytes / (ms * 1e-3) if gbytes is not None else None
    tfs = tflop / (ms * 1e-3) if tflop is not None else None
    cells = [
        name,
        f"{ms * 1e3:9.1f}",
        f"{gbs:7.0f}" if gbs is not None else "",
        f"{100 * gbs / copy_bw:5.0f}%" if gbs is not None else "",
        f"{tfs:6.1f}" if tfs is not None else "",
        f"{100 * tfs / mm_rate:5.0f}%" if tfs is not None else "",
        f"{ref_ms * 1e3:9.1f}" if ref_ms is not None else "",
        f"{err:.1e}" if err is not None else "",
    ]
    line = "| " + " | ".join(cells) + " |"
    ROWS.append(line)
    print(line, flush=True)


HEADER = (
    "| case | time (us) | GB/s | of copy BW | TFLOP/s | of matmul | torch baseline (us) | rel err vs ref |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|"
)
NOTE = (
    "torch baseline: for attention, torch scaled_dot_product_attention (enable_gqa) over a contiguous,\n"
    "unpaged copy of the same K/V (no block-table gather); for the other kernels, the eager torch reference.\n"
    "GB/s counts the bytes a kernel must move at least (K/V of the whole context read once, q/out once)."
)


def measure_ceilings():
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=DT)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), graph=False)  # eager: a captured memcpy runs on the copy engines
    copy_bw = 2 * n * 2 / (ms * 1e-3) / 1e9  # read + write
    src = dst = None  # free them before the next allocation
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn(8192, 8192, device=DEV, dtype=DT)
    ms = bench(lambda: a @ b, graph=False)
    mm = 2 * 8192**3 / (ms * 1e-3) / 1e12
    a = b = None
    torch.cuda.empty_cache()
    return copy_bw, mm


def make_cache(batch, ctx, q_len, prefix):
    """Uniform batch: each sequence has `ctx` tokens in the cache of which the last q_len are new."""
    blocks_per = triton.cdiv(ctx, BS)
    nb = batch * blocks_per
    bt = torch.randperm(nb, device=DEV, dtype=torch.int64).view(batch, blocks_per).to(torch.int32)
    kc = torch.randn(nb, BS, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn(nb, BS, HKV, D, device=DEV, dtype=DT)
    q = torch.randn(batch * q_len, HQ, D, device=DEV, dtype=DT)
    sl = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * q_len
    return q, kc, vc, bt, sl, cu


def check_subset(q, kc, vc, bt, sl, cu, out, scale, q_len, n=4):
    """Reference on the first n sequences (the torch reference loops over sequences)."""
    n = min(n, bt.shape[0])
    ref = pa.paged_attention_torch(q[: n * q_len], kc, vc, bt[:n], sl[:n], cu[: n + 1], scale)
    return rel_err(out[: n * q_len], ref)


def sdpa_contig(q, kc, vc, bt, batch, ctx, q_len):
    """torch SDPA over contiguous K/V gathered from the pages (not timed: the gather)."""
    k = kc[bt.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()  # [B, Hkv, ctx, D]
    v = vc[bt.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    qq = q.view(batch, q_len, HQ, D).transpose(1, 2)
    causal = q_len > 1
    if causal and q_len != ctx:
        return None
    fn = lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=causal, enable_gqa=True)
    try:
        ms = bench(fn)
    except Exception as e:  # backend without GQA support, say
        print(f"  (sdpa failed: {type(e).__name__}: {e})")
        ms = None
    k = v = None
    return ms


def decode_case(batch, ctx, copy_bw, label=None, with_sdpa=True):
    scale = D**-0.5
    q, kc, vc, bt, sl, cu = make_cache(batch, ctx, 1, ctx - 1)
    out = torch.empty_like(q)
    fn = lambda: pa.paged_attention_triton(q, kc, vc, bt, sl, cu, scale, 1, out=out)
    out.fill_(float("nan"))
    fn()
    err = check_subset(q, kc, vc, bt, sl, cu, out, scale, 1)
    ms = bench(fn)
    gbytes = (batch * ctx * HKV * D * 2 * 2 + 2 * q.numel() * 2) / 1e9
    ref_ms = sdpa_contig(q, kc, vc, bt, batch, ctx, 1) if with_sdpa else None
    splits = pa.decode_num_splits(batch, HKV, bt.shape[1] * BS, torch.cuda.get_device_properties(0).multi_processor_count, pa.DECODE_CONFIG["block_n"])
    row(label or f"decode B={batch} ctx={ctx} (splits={splits})", ms, gbytes, copy_bw, err=err, ref_ms=ref_ms)
    q = kc = vc = bt = None
    torch.cuda.empty_cache()
    return ms


def prefill_case(batch, q_len, prefix, copy_bw, mm_rate, label=None, with_sdpa=True):
    scale = D**-0.5
    ctx = prefix + q_len
    q, kc, vc, bt, sl, cu = make_cache(batch, ctx, q_len, prefix)
    out = torch.empty_like(q)
    fn = lambda: pa.paged_attention_triton(q, kc, vc, bt, sl, cu, scale, q_len, out=out)
    out.fill_(float("nan"))
    fn()
    err = check_subset(q, kc, vc, bt, sl, cu, out, scale, q_len, n=2)
    ms = bench(fn)
    # causal: new token i (0-based) sees prefix + i + 1 keys; 2 flops per MAC, QK^T and PV
    keys = batch * (q_len * prefix + q_len * (q_len + 1) // 2)
    tflop = 4 * keys * D * HQ / 1e12
    gbytes = (batch * ctx * HKV * D * 2 * 2 + 2 * q.numel() * 2) / 1e9
    ref_ms = sdpa_contig(q, kc, vc, bt, batch, ctx, q_len) if with_sdpa else None
    row(label or f"prefill B={batch} new={q_len} cached={prefix}", ms, gbytes, copy_bw, tflop, mm_rate, err, ref_ms)
    q = kc = vc = bt = None
    torch.cuda.empty_cache()
    return ms


def small_kernels(copy_bw, t=4096):
    x = torch.randn(t, HIDDEN, device=DEV, dtype=DT)
    r = torch.randn(t, HIDDEN, device=DEV, dtype=DT)
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEV)).to(DT)
    err = rel_err(norm.rms_norm_triton(x, w, 1e-5), norm.rms_norm_torch(x, w, 1e-5))
    ms = bench(lambda: norm.rms_norm_triton(x, w, 1e-5))
    ref_ms = bench(lambda: norm.rms_norm_torch(x, w, 1e-5))
    row(f"rms_norm T={t} H={HIDDEN} (ref: torch eager)", ms, 2 * x.numel() * 2 / 1e9, copy_bw, err=err, ref_ms=ref_ms)
    n1, r1 = norm.fused_add_rms_norm_triton(x, r, w, 1e-5)
    n2, r2 = norm.fused_add_rms_norm_torch(x, r, w, 1e-5)
    err = max(rel_err(n1, n2), rel_err(r1, r2))
    ms = bench(lambda: norm.fused_add_rms_norm_triton(x, r, w, 1e-5))
    ref_ms = bench(lambda: norm.fused_add_rms_norm_torch(x, r, w, 1e-5))
    row(f"fused_add_rms_norm T={t}", ms, 4 * x.numel() * 2 / 1e9, copy_bw, err=err, ref_ms=ref_ms)

    xg = torch.randn(t, 2 * INTER, device=DEV, dtype=DT)
    err = rel_err(activation.silu_and_mul_triton(xg), activation.silu_and_mul_torch(xg))
    ms = bench(lambda: activation.silu_and_mul_triton(xg))
    ref_ms = bench(lambda: activation.silu_and_mul_torch(xg))
    row(f"silu_and_mul T={t} I={INTER}", ms, 1.5 * xg.numel() * 2 / 1e9, copy_bw, err=err, ref_ms=ref_ms)
    xg = None

    cache = rotary.build_cos_sin_cache(8192, D, base=500000.0, device=DEV)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=DT)
    q, k, v = (x.view(t, -1, D) for x in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    nb = 4 * t // BS
    kc = torch.randn(nb, BS, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(nb * BS, device=DEV)[:t]
    q_ref = rotary.rotary_store_kv_torch(pos, q.clone(), k, v, cache, kc, vc, slots)
    rotary.rotary_store_kv_triton(pos, q, k, v, cache, kc2, vc2, slots)
    err = max(rel_err(q, q_ref), rel_err(kc2, kc), rel_err(vc2, vc))
    ms = bench(lambda: rotary.rotary_store_kv_triton(pos, q, k, v, cache, kc2, vc2, slots))  # q in place: fine for timing
    ref_ms = bench(lambda: rotary.rotary_store_kv_torch(pos, q, k, v, cache, kc, vc, slots), graph=False)  # host sync
    moved = (2 * q.numel() + 4 * k.numel()) * 2 / 1e9  # q read+written, k and v read and written to the cache
    row(f"rotary + store_kv T={t} (on qkv views)", ms, moved, copy_bw, err=err, ref_ms=ref_ms)


def sweep(copy_bw, mm_rate):
    print("\n## decode config sweep (block_n, num_warps, num_stages)")
    saved = dict(pa.DECODE_CONFIG)
    for bn, nw, ns in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (32, 2, 3)]:
        pa.DECODE_CONFIG.update(block_n=bn, num_warps=nw, num_stages=ns)
        for b, c in [(1, 32768), (32, 4096), (128, 4096)]:
            decode_case(b, c, copy_bw, label=f"sweep decode bn={bn} w={nw} s={ns} B={b} ctx={c}", with_sdpa=False)
    pa.DECODE_CONFIG.clear()
    pa.DECODE_CONFIG.update(saved)
    for waves in (2, 8):
        pa.DECODE_CONFIG["waves"] = waves
        for b, c in [(1, 4096), (32, 4096)]:
            decode_case(b, c, copy_bw, label=f"sweep decode waves={waves} B={b} ctx={c}", with_sdpa=False)
    pa.DECODE_CONFIG.update(saved)

    print("\n## prefill config sweep (block_m, block_n, num_warps, num_stages)")
    saved = dict(pa.PREFILL_CONFIG[128])
    for bm, bn, nw, ns in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 128, 4, 2)]:
        pa.PREFILL_CONFIG[128].update(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            prefill_case(1, 4096, 0, copy_bw, mm_rate, label=f"sweep prefill bm={bm} bn={bn} w={nw} s={ns}", with_sdpa=False)
        except Exception as e:  # e.g. out of shared memory
            print(f"| sweep prefill bm={bm} bn={bn} w={nw} s={ns} | failed: {type(e).__name__} |")
    pa.PREFILL_CONFIG[128].update(saved)


def prefill_sweep(copy_bw, mm_rate):
    """The causal prefill kernel at 2k, 4k and 8k tokens (one sequence, nothing cached) over tiles."""
    print("\n## prefill sweep (block_m, block_n, num_warps, num_stages)")
    saved = dict(pa.PREFILL_CONFIG[128])
    for bm, bn, nw, ns in [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3)]:
        pa.PREFILL_CONFIG[128].update(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        for q_len in (2048, 4096, 8192):
            label = f"prefill {q_len} bm={bm} bn={bn} w={nw} s={ns}"
            try:
                prefill_case(1, q_len, 0, copy_bw, mm_rate, label=label, with_sdpa=False)
            except Exception as e:  # e.g. out of shared memory
                print(f"| {label} | failed: {type(e).__name__} |")
    pa.PREFILL_CONFIG[128].clear()
    pa.PREFILL_CONFIG[128].update(saved)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--prefill-sweep", action="store_true", help="only the prefill kernel's tiles at 2k-8k tokens")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-graph", action="store_true", help="time eager launches instead of graph replays")
    args = ap.parse_args()
    global GRAPH
    GRAPH = not args.no_graph
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    commit = os.environ.get("BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except Exception:
            commit = "?"
    head = (
        f"date {datetime.date.today()}  device {props.name} ({props.multi_processor_count} SMs)  "
        f"torch {torch.__version__}  triton {triton.__version__}  python {sys.version.split()[0]}  commit {commit or '?'}"
    )
    head += f"  timing: {'CUDA-graph replay' if GRAPH else 'eager launches'}, median"
    print(head)
    copy_bw, mm_rate = measure_ceilings()
    print(f"copy bandwidth (2 GiB bf16 device-to-device, read+write): {copy_bw:.0f} GB/s; bf16 matmul 8192^3: {mm_rate:.0f} TFLOP/s")
    print(f"decode config {pa.DECODE_CONFIG}; prefill config (head_dim 128) {pa.PREFILL_CONFIG[128]}\n")
    print(HEADER)
    if args.prefill_sweep:
        return prefill_sweep(copy_bw, mm_rate)
    for b in (1, 32, 128):
        for c in (1024, 4096, 32768):
            decode_case(b, c, copy_bw)
    prefill_case(1, 4096, 0, copy_bw, mm_rate)
    prefill_case(4, 1024, 0, copy_bw, mm_rate)
    prefill_case(1, 4096, 12288, copy_bw, mm_rate, with_sdpa=False)  # chunk over a cached prefix
    prefill_case(1, 512, 3584, copy_bw, mm_rate, with_sdpa=False)
    small_kernels(copy_bw)
    main_rows = list(ROWS)
    if args.sweep:
        print("\n" + HEADER)
        sweep(copy_bw, mm_rate)
    text = "\n".join([head, f"copy bandwidth {copy_bw:.0f} GB/s, bf16 matmul {mm_rate:.0f} TFLOP/s", NOTE, "", HEADER, *main_rows])
    if args.sweep:
        text += "\n\nsweeps:\n" + HEADER + "\n" + "\n".join(ROWS[len(main_rows):])
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
