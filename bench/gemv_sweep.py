"""One-row matrix-vector products (batch-1 decode) on the 8B shape's projections, TP=1 and TP=2
slices: cuBLAS (F.linear) against the Triton GEMV kernel over a grid of launch settings, each
timed from a CUDA graph that cycles through enough weight copies to overflow L2 (as in a real
step, where each layer's weights come from HBM). Prints a table and the GEMV_SHAPES entries
(engine/kvship/kernels/tuning/gemv.py) for the shapes where the best setting beats cuBLAS.

    python bench/gemv_sweep.py [--quick] [--more | --gpt-oss | --deepseek | --absorbed] [--best-json PATH]

--deepseek also times the absorbed attention's per-head products (kernels/gemv.py head_matmul),
--absorbed only those.
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
from kvship.kernels import gemv

# (name, N, K): q/k/v, o, gate/up, down of Llama-3-8B at TP=1, then rank slices at TP=2.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("qkv tp2", 3072, 4096), ("o tp2", 4096, 2048), ("gate_up tp2", 14336, 4096), ("down tp2", 4096, 7168)]
# --more: the attention projections and router of Qwen3-30B-A3B (its MLPs are experts) and Gemma-2-9B's and
# Phi-4's projections, which bench/latency.py's other shapes run through.
MORE_SHAPES = [("a3b qkv", 5120, 2048), ("a3b o", 2048, 4096), ("a3b router", 128, 2048), ("gemma2 qkv", 8192, 3584),
               ("gemma2 o", 3584, 4096), ("gemma2 gate_up", 28672, 3584), ("gemma2 down", 3584, 14336),
               ("phi4 qkv", 7680, 5120), ("phi4 o", 5120, 5120), ("phi4 down", 5120, 17920)]
# --gpt-oss: gpt-oss's q/k/v (with biases) and o projections and routers (20b: 32 experts, 120b: 128); as
# many bytes a token as its MXFP4 experts
GPT_OSS_SHAPES = [("gpt-oss qkv", 5120, 2880), ("gpt-oss o", 2880, 4096), ("gpt-oss-20b router", 32, 2880),
                  ("gpt-oss-120b router", 128, 2880)]
# --deepseek: DeepSeek-V2-Lite's and Moonlight's q, latent (kv_a) and o projections, their router, the shared
# experts' gate/up and down, and their first (dense) layer's MLP
DEEPSEEK_SHAPES = [("ds q", 3072, 2048), ("ds kv_a", 576, 2048), ("ds o", 2048, 2048), ("ds shared gate_up", 5632, 2048),
                   ("ds shared down", 2048, 2816), ("v2-lite dense gate_up", 21888, 2048),
                   ("v2-lite dense down", 2048, 10944), ("moonlight dense gate_up", 22528, 2048),
                   ("moonlight dense down", 2048, 11264)]


def time_per_call(fn_per_copy, copies: int, reps: int = 20) -> float:
    """Microseconds per call: a graph of `copies` calls (distinct weights) replayed `reps` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(copies):
            fn_per_copy(i)  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn_per_copy(i)
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * copies)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small grid of settings")
    ap.add_argument("--more", action="store_true", help="the other bench shapes' projections instead of Llama-3-8B's")
    ap.add_argument("--gpt-oss", action="store_true", help="gpt-oss's attention projections and routers instead")
    ap.add_argument("--deepseek", action="store_true", help="DeepSeek-V2-Lite's and Moonlight's instead")
    ap.add_argument("--absorbed", action="store_true", help="only DeepSeek's absorbed per-head products")
    ap.add_argument("--best-json", help="write the GEMV_SHAPES entries found here, as [[N, K], setting] pairs "
                    "(bench/latency.py --settings tries them)")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    copy_bw, _ = measure_ceilings()
    grid = list(itertools.product([4, 8, 16, 32], [512, 1024, 2048], [2, 4, 8], [1, 3]))
    if args.quick:
        grid = [(16, 512, 4, 3), (32, 256, 4, 3), (8, 1024, 4, 1)]
    rows, best_table = [], {}
    if args.deepseek:
        grid = list(itertools.product([4, 8, 16], [512, 1024, 2048], [2, 4, 8], [1, 3]))
    shapes = ([] if args.absorbed else DEEPSEEK_SHAPES if args.deepseek else MORE_SHAPES if args.more
              else GPT_OSS_SHAPES if args.gpt_oss else SHAPES)
    for name, n, k in shapes:
        copies = max(4, -(-300_000_000 // (n * k * 2)))  # > 2x the 50 MB L2 every replay
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        ref = torch.nn.functional.linear(x, ws[0])
        cublas_us = time_per_call(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
        best = None
        for bn, bk, nw, ns in grid:
            cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            try:
                out = gemv.gemv_triton(x, ws[0], None, cfg)
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                if err > 1e-2:
                    print(f"  {name} {cfg}: rel err {err:.1e}, skipped", file=sys.stderr)
                    continue
                us = time_per_call(lambda i: gemv.gemv_triton(x, ws[i], None, cfg), copies)
            except Exception as e:  # out of resources for this setting
                print(f"  {name} {cfg}: {type(e).__name__}", file=sys.stderr)
                continue
            if best is None or us < best[0]:
                best = (us, cfg, err)
        pct = lambda us: f"{100 * n * k * 2 / (us * 1e-6) / copy_bw:.0f}%"
        rows.append([name, f"{n}x{k}", f"{cublas_us:.1f}", pct(cublas_us),
                     f"{best[0]:.1f}" if best else "-", pct(best[0]) if best else "-",
                     str(best[1]) if best else "-", f"{best[2]:.0e}" if best else "-"])
        if best and best[0] < 0.97 * cublas_us:
            best_table[(n, k)] = best[1]
        ws = None
        torch.cuda.empty_cache()
    if args.deepseek or args.absorbed:
        rows += absorbed_rows(copy_bw)
    print(header("One-row GEMV (batch-1 decode projections): cuBLAS vs Triton, weights streamed from HBM"))
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (as the roofline in latency.py); % = weight bytes ÷ time ÷ that\n")
    print(table(rows, ["weight", "N x K", "cuBLAS µs", "cuBLAS % BW", "Triton µs", "Triton % BW", "best setting", "rel err"]))
    print("\nGEMV_SHAPES = {")
    for (n, k), cfg in best_table.items():
        print(f"    ({n}, {k}): {cfg},")
    print("}")
    if args.best_json:
        Path(args.best_json).write_text(json.dumps([[list(key), cfg] for key, cfg in best_table.items()]))


def absorbed_rows(copy_bw: float) -> list[list[str]]:
    """DeepSeek's absorbed products at one token (16 heads, nope = v = 128, rank 512, the blocks
    sliced out of kv_b_proj as models/deepseek_v2.py does): torch.bmm as the model ran them
    before, the result laid out for o_proj (its copy counted), against kernels/gemv.py's
    head_gemv_triton over a small grid of settings."""
    heads, nope, v, rank, dev, dt = 16, 128, 128, 512, "cuda", torch.bfloat16
    copies = max(4, -(-300_000_000 // (heads * (nope + v) * rank * 2)))
    ws = [torch.randn(heads, nope + v, rank, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
    q = torch.randn(1, heads, nope + 64, device=dev, dtype=dt)[:, :, :nope]
    o = torch.randn(1, heads, rank, device=dev, dtype=dt)
    rows = []
    for name, x, part, transposed in (("ds W_UK (q_nope -> latent)", q, slice(None, nope), True),
                                      ("ds W_UV (latent -> v)", o, slice(nope, None), False)):
        n_bytes = heads * 128 * rank * 2
        bmm_us = time_per_call(lambda i: gemv.head_matmul_torch(x, ws[i][:, part], transposed).reshape(1, -1)
                               .contiguous(), copies)
        ref = gemv.head_matmul_torch(x, ws[0][:, part], transposed).float()
        best = None
        for bn, bk, nw in itertools.product([8, 16, 32, 64], [128, 256, 512], [2, 4, 8]):
            cfg = dict(block_n=bn, block_k=bk, num_warps=nw)
            err = ((gemv.head_gemv_triton(x, ws[0][:, part], transposed, cfg).float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                print(f"  {name} {cfg}: rel err {err:.1e}, skipped", file=sys.stderr)
                continue
            us = time_per_call(lambda i: gemv.head_gemv_triton(x, ws[i][:, part], transposed, cfg), copies)
            if best is None or us < best[0]:
                best = (us, cfg, err)
        pct = lambda us: f"{100 * n_bytes / (us * 1e-6) / copy_bw:.0f}%"
        cfg = gemv.HEAD_GEMV_CONFIG[transposed]
        engine_us = time_per_call(lambda i: gemv.head_gemv_triton(x, ws[i][:, part], transposed), copies)
        rows.append([name, f"{heads}x128x{rank}", f"{bmm_us:.1f} (bmm + copy)", pct(bmm_us), f"{best[0]:.1f}",
                     pct(best[0]), f"{best[1]}; engine's {cfg}: {engine_us:.1f}", f"{best[2]:.0e}"])
    return rows


if __name__ == "__main__":
    main()
