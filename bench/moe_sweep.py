"""Few-token MoE kernels (kernels/fused_moe.py, ``fused_moe_gemv``) over a grid of launch
settings at Qwen3-30B-A3B's sizes, against the grouped-GEMM path, each timed from a CUDA graph
cycling through enough layers' experts (random bf16) to overflow L2. Bytes: the distinct experts
the tokens pick (gate, up and down rows); % BW = bytes ÷ time ÷ copy bandwidth measured in the
same run. Routing is computed outside the timed region (same for both paths).

    python bench/moe_sweep.py [--tokens 1 4] [--quick]

The one-token settings (kernels/tuning/moe.py: GEMV_GATE_UP, GEMV_DOWN) come from the best line here.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import fused_moe as fm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    c = SHAPES[args.shape]
    e, k, h, inter = c["num_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]
    bw, _ = measure_ceilings()
    layer_bytes = e * 3 * h * inter * 2
    copies = max(3, -(-3_000_000_000 // layer_bytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [(torch.randn(e, 2 * inter, h, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02,
               torch.randn(e, h, inter, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(copies)]
    router = torch.randn(e, h, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    # K tiles up to the whole row (one pass: every load of a program in flight at once; the loops
    # are not software-pipelined, num_stages has no effect), kept where each thread holds 32 to 256
    # fp32 accumulators (fewer: too little in flight; more: registers spill). A gate/up program
    # holds 2 x block_n rows, a down program block_n rows of each of the k experts.
    def tiles(block_ns, rows_per_n, width):
        return [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=3)
                for bn, bk, nw in itertools.product(block_ns, [256, 512, 1024, 2048], [2, 4, 8])
                if bk <= triton.next_power_of_2(width) and 32 <= rows_per_n * bn * bk / (32 * nw) <= 256]

    gate_up = [t for t in tiles([4, 8, 16], 2, h) if t["block_k"] >= 512]
    down = tiles([1, 2, 4, 8], k, inter)
    if args.quick:
        gate_up, down = gate_up[::4], down[::3]
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
        weights, ids = fm.route(x @ router.T, k, c.get("norm_topk_prob", False))
        nbytes = ids.unique().numel() * 3 * h * inter * 2
        want = fm.fused_moe_torch(x.float(), layers[0][0].float(), layers[0][1].float(), weights, ids)

        def err(out):
            return ((out.float() - want).norm() / want.norm()).item()

        def row(name, us, e_rel):
            rows.append([str(t), name, f"{us:.1f}", f"{nbytes / us / 1e3:.0f}", f"{100 * nbytes / us / 1e-6 / bw:.0f}%",
                         f"{e_rel:.1e}"])

        grouped = fm.moe_config(t, k, e)
        row(f"grouped GEMMs {grouped}", time_per_call(
            lambda i: fm.fused_moe_triton(x, *layers[i], weights, ids, config=grouped), copies),
            err(fm.fused_moe_triton(x, *layers[0], weights, ids, config=grouped)))
        # each kernel's settings found with the other at its default, then the pair together
        best_gu = min(gate_up, key=lambda cfg: time_per_call(
            lambda i: fm.fused_moe_gemv(x, *layers[i], weights, ids, gate_up=cfg), copies))
        best_dn = min(down, key=lambda cfg: time_per_call(
            lambda i: fm.fused_moe_gemv(x, *layers[i], weights, ids, gate_up=best_gu, down=cfg), copies))
        for name, gu, dn in (("gemv, defaults", None, None), (f"gemv, gate/up {best_gu}, down {best_dn}",
                                                               best_gu, best_dn)):
            row(name, time_per_call(lambda i: fm.fused_moe_gemv(x, *layers[i], weights, ids, gate_up=gu, down=dn),
                                    copies),
                err(fm.fused_moe_gemv(x, *layers[0], weights, ids, gate_up=gu, down=dn)))
    print(header(f"Few-token MoE kernels, {args.shape} (E {e}, top {k}, hidden {h}, intermediate {inter}), bf16"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {copies} layers' experts cycled\n")
    print(table(rows, ["tokens", "path", "us per layer", "GB/s", "of copy BW", "rel err vs fp32"]))


if __name__ == "__main__":
    main()
