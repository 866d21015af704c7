"""Few-token MoE kernels (kernels/fused_moe.py, ``fused_moe_gemv``) over a grid of launch
settings at Qwen3-30B-A3B's sizes, against the grouped-GEMM path, each timed from a CUDA graph
cycling through enough layers' experts (random bf16) to overflow L2. Bytes: the distinct experts
the tokens pick (gate, up and down rows); % BW = bytes ÷ time ÷ copy bandwidth measured in the
same run. Routing is computed outside the timed region (same for both paths).

    python bench/moe_sweep.py [--tokens 1 4] [--quick]

The one-token settings (kernels/tuning/moe.py: GEMV_GATE_UP, GEMV_DOWN) come from the best line here.

    python bench/moe_sweep.py --mxfp4 [--shape gpt-oss-20b] [--tokens 1 2 4 8 16] [--quick] [--best-json F]
                                  [--table-only]

gpt-oss's MXFP4 experts (kernels/mxfp4_gemv.py) the same way: per token count the grouped GEMMs,
the GEMVs' current table, then each GEMV's settings swept (gate/up with down at the table's, down
with the best gate/up); bytes are the distinct experts' codes and scales. It ends with the winning
table as Python for kernels/tuning/moe.py's MXFP4_GEMV (token counts where the GEMVs beat the
grouped GEMMs); --best-json writes it for `bench/latency.py --settings`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import fused_moe as fm
from kvship.kernels import gpt_oss_moe as gm
from kvship.kernels import mxfp4_gemv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mxfp4", action="store_true", help="gpt-oss's MXFP4 experts (default shape gpt-oss-20b)")
    ap.add_argument("--best-json", help="with --mxfp4: write the winning MXFP4_GEMV table here")
    ap.add_argument("--table-only", action="store_true",
                    help="with --mxfp4: the grouped GEMMs and the current table only, no sweep (an A/B of two trees)")
    args = ap.parse_args()
    if args.mxfp4:
        return mxfp4_sweep(args)
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


def random_mxfp4_experts(e: int, h: int, inter: int, g: torch.Generator) -> gm.GptOssExperts:
    """One layer's experts on the GPU as kernels/gpt_oss_moe.py takes them: MXFP4 codes of any
    value with scales near 2 ** -6, biases with std 0.1."""
    def mxfp4(n, kk):
        return (torch.randint(0, 256, (e, n, kk // 2), generator=g, device="cuda", dtype=torch.uint8),
                torch.randint(119, 123, (e, n, kk // 32), generator=g, device="cuda", dtype=torch.uint8))

    (w13, s13), (w2, s2) = mxfp4(2 * inter, h), mxfp4(h, inter)
    b13, b2 = (torch.randn(e, n, generator=g, device="cuda") * 0.1 for n in (2 * inter, h))
    return gm.GptOssExperts(w13, b13, w2, b2, s13, s2)


def mxfp4_candidates(rows_per_n: int, quick: bool) -> list[dict]:
    """GEMV settings where each thread holds 1 to 4 (row, group) slots of 16 code bytes (fewer:
    threads idle; more: registers spill); a program holds rows_per_n rows a block_n row (gate
    and up: 2; down: the k experts). The packed-pair decode in full (with x as made each tile,
    and as words made once: ``x_words``), the float32 one sampled.
    Tiles of 64 and 128 groups take gpt-oss's 90 in one or two iterations: x's tile, put into
    the codes' layout through shared memory each iteration, then once or twice a program."""
    grid = [dict(block_n=bn, block_g=bg, num_warps=nw)
            for bn, bg, nw in itertools.product([1, 2, 4, 8, 16], [4, 8, 16, 32, 64, 128], [1, 2, 4])
            if 32 * nw <= rows_per_n * bn * bg <= 4 * 32 * nw]
    out = ([dict(cfg, pairs=1) for cfg in grid] + [dict(cfg, pairs=1, x_words=1) for cfg in grid]
           + [dict(cfg, pairs=0) for cfg in grid[::4]])
    return out[::3] if quick else out


def timed_or_failed(fn, copies: int) -> float:
    """time_per_call, or infinity (reported) where a setting does not compile or run."""
    try:
        return time_per_call(fn, copies)
    except Exception as exc:  # a setting past the registers or an unsupported instruction
        print(f"failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return float("inf")


@torch.inference_mode()
def mxfp4_sweep(args) -> None:
    shape = "gpt-oss-20b" if args.shape == "qwen3-30b-a3b" else args.shape
    c = SHAPES[shape]
    e, k, h, inter = c["num_local_experts"], c["num_experts_per_tok"], c["hidden_size"], c["intermediate_size"]
    tokens = args.tokens if args.tokens != [1, 4] else [1, 2, 4, 8, 16]
    bw, _ = measure_ceilings()
    per_expert = 3 * h * inter // 2 + 3 * h * inter // 32  # codes + scales
    copies = max(3, -(-3_000_000_000 // (e * per_expert)))
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [random_mxfp4_experts(e, h, inter, g) for _ in range(copies)]
    router = torch.randn(e, h, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    gate_up_grid, down_grid = mxfp4_candidates(2, args.quick), mxfp4_candidates(k, args.quick)
    rows, winners, winning = [], [], True
    for t in sorted(tokens):
        x = torch.randn(t, h, generator=g, device="cuda", dtype=torch.bfloat16)
        weights, ids = fm.route(x @ router.T, k, True)
        nbytes = ids.unique().numel() * per_expert
        want = gm.gpt_oss_moe_torch(x.float(), layers[0], weights, ids)

        def gemv(i, gu, dn):
            ex = layers[i]
            return mxfp4_gemv.mxfp4_moe_gemv(x, ex.w13, ex.w13_scale, ex.w13_bias, ex.w2, ex.w2_scale, ex.w2_bias,
                                             weights, ids, ex.alpha, ex.limit, gu, dn)

        def row(name, us, out):
            err = ((out.float() - want).norm() / want.norm()).item()
            rows.append([str(t), name, f"{us:.1f}", f"{nbytes / us / 1e3:.0f}", f"{100 * nbytes / us / 1e-6 / bw:.0f}%",
                         f"{err:.1e}"])

        cfg = fm.moe_config(t, k, e)
        grouped = time_per_call(lambda i: gm.gpt_oss_moe_triton(x, layers[i], weights, ids, config=cfg), copies)
        row(f"grouped GEMMs {cfg}", grouped, gm.gpt_oss_moe_triton(x, layers[0], weights, ids, config=cfg))
        gu0, dn0 = mxfp4_gemv.gemv_settings(t) or mxfp4_gemv.MXFP4_GEMV[-1][1:]
        row(f"gemv, table: gate/up {gu0}, down {dn0}", time_per_call(lambda i: gemv(i, gu0, dn0), copies),
            gemv(0, gu0, dn0))
        if args.table_only:
            continue
        best_gu = min(gate_up_grid, key=lambda gu: timed_or_failed(lambda i: gemv(i, gu, dn0), copies))
        best_dn = min(down_grid, key=lambda dn: timed_or_failed(lambda i: gemv(i, best_gu, dn), copies))
        best = time_per_call(lambda i: gemv(i, best_gu, best_dn), copies)
        row(f"gemv, swept: gate/up {best_gu}, down {best_dn}", best, gemv(0, best_gu, best_dn))
        if best < grouped and winning:
            winners.append((t, best_gu, best_dn))
        winning = winning and best < grouped  # the table covers 1 token up to the last count won
        if args.best_json:  # as it grows: a sweep cut short still leaves what it found
            Path(args.best_json).write_text(json.dumps([["mxfp4_gemv", winners]]))
        print(table(rows[-3:], ["tokens", "path", "us per layer", "GB/s", "of copy BW", "rel err"]), flush=True)
    print(header(f"Few-token MXFP4 MoE kernels, {shape} (E {e}, top {k}, hidden {h}, intermediate {inter}), "
                 "bf16 activations"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {copies} layers' experts cycled; bytes: the distinct experts' "
          "codes and scales\n")
    print(table(rows, ["tokens", "path", "us per layer", "GB/s", "of copy BW", "rel err vs fp32"]))
    print("\n# kernels/tuning/moe.py\nMXFP4_GEMV = (\n" + "".join(f"    ({t}, {json.dumps(gu)}, {json.dumps(dn)}),\n"
                                                            for t, gu, dn in winners)
          + ")")


if __name__ == "__main__":
    main()
