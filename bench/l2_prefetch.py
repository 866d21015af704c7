"""Can the next layer's attention weights wait in L2 while a MoE layer's experts stream? A probe.

At batch 1 the Qwen3-30B-A3B step spends about 24 us a layer in its expert kernels at some 73% of
copy bandwidth, and about 14 us in the q/k/v and o one-row GEMVs (38 MB at some 64%); 60% of the
roofline needs a 2.41 ms step against 2.70. The attention weights of layer L + 1 are known before
layer L's experts run. Here a small kernel on a second stream reads them (kernels/l2_warm.py:
``evict_last``, the values dropped) while the experts' two kernels run, and the GEMVs follow. Timed from one CUDA
graph per case, cycling through enough layers to overflow L2 (gemv_sweep.time_per_call), in us a
layer:

- cold: experts, then q/k/v and o from HBM (as the engine runs now);
- touched: the same with the side kernel of P programs reading q/k/v and o during the experts;
- hot: the GEMVs alone on one layer's weights, replayed (their L2-resident floor), and the
  experts alone;
- read first: the same read on the main stream before the experts, which shows whether the lines
  outlive the experts' 75 MB (read with evict_first) at all.

A touched time near experts + hot says the idea holds on this GPU; near cold, that the lines
were gone (or never held) by the time the GEMVs read them, as a same-kernel L2 prefetch measured
on 2026-12-03 (docs/benchmarks.md, "Tried and dropped").

    python bench/l2_prefetch.py [--programs 8 16 32 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, header, measure_ceilings, table
from gemv_sweep import time_per_call
from kvship.kernels import fused_moe as fm
from kvship.kernels import gemv
from kvship.kernels.l2_warm import warm_l2
from kvship.layers import prefetch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32, 64])
    args = ap.parse_args()
    c = SHAPES["qwen3-30b-a3b"]
    e, k, h, inter = c["num_experts"], c["num_experts_per_tok"], c["hidden_size"], c["moe_intermediate_size"]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    bw, _ = measure_ceilings()
    layer_bytes = e * 3 * h * inter * 2
    copies = max(3, -(-3_000_000_000 // layer_bytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02  # noqa: E731
    experts = [(rnd(e, 2 * inter, h), rnd(e, h, inter)) for _ in range(copies)]
    qkv = [rnd((heads + 2 * kv) * d, h) for _ in range(copies)]
    o = [rnd(h, heads * d) for _ in range(copies)]
    x, xo = rnd(1, h), rnd(1, heads * d)
    weights, ids = fm.route(x @ rnd(e, h).T, k, True)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    cfg_qkv, cfg_o = gemv.GEMV_SHAPES.get(tuple(qkv[0].shape)), gemv.GEMV_SHAPES.get(tuple(o[0].shape))

    def moe(i):
        fm.fused_moe_gemv(x, *experts[i], weights, ids)

    def attn(i):
        gemv.gemv_triton(x, qkv[i], None, cfg_qkv)
        gemv.gemv_triton(xo, o[i], None, cfg_o)

    def cold(i):
        moe(i)
        attn(i)

    def touched(programs):  # the engine's fork and join (layers/prefetch.py), at this many programs
        def layer(i):
            prefetch.PROGRAMS = programs
            with prefetch.WarmDuring([qkv[i], o[i]], side, sink):
                moe(i)
            attn(i)
        return layer

    def touched_before(i):  # the read on the same stream, before the experts: do the lines outlive them?
        warm_l2([qkv[i], o[i]], 132, sink)
        moe(i)
        attn(i)

    attn_bytes = (qkv[0].numel() + o[0].numel()) * 2
    t_moe = time_per_call(moe, copies)
    t_attn_cold = time_per_call(attn, copies)
    t_attn_hot = time_per_call(lambda i: attn(0), copies)
    t_cold = time_per_call(cold, copies)
    rows = [["experts alone", f"{t_moe:.1f}", ""], ["q/k/v + o alone, from HBM", f"{t_attn_cold:.1f}",
                                                    f"{100 * attn_bytes / (t_attn_cold * 1e-6) / bw:.0f}% of copy BW"],
            ["q/k/v + o alone, one layer's weights replayed (L2)", f"{t_attn_hot:.1f}", ""],
            ["experts, then q/k/v + o (the engine now)", f"{t_cold:.1f}", ""],
            ["floor: experts + q/k/v + o from L2", f"{t_moe + t_attn_hot:.1f}", ""]]
    t = time_per_call(touched_before, copies)
    rows.append(["q/k/v + o read first (132 programs), then experts, then q/k/v + o", f"{t:.1f}",
                 "the GEMVs gain if the lines outlive the experts' stream"])
    for p in args.programs:
        t = time_per_call(touched(p), copies)
        rows.append([f"experts with q/k/v + o read alongside ({p} programs), then q/k/v + o", f"{t:.1f}",
                     f"{t_cold - t:+.1f} us against the engine's order"])
    print(header("Qwen3-30B-A3B, batch 1: q/k/v and o weights read into L2 while the experts stream"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {copies} layers cycled; q/k/v + o {attn_bytes / 1e6:.1f} MB a layer\n")
    print(table(rows, ["case", "us a layer", "note"]))


if __name__ == "__main__":
    main()
