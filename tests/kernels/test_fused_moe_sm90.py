"""The fused MoE kernels (routers, alignment, grouped GEMM) compile for sm_90 (H100/H200) in every
variant the engine launches, with its launch's warps, pipeline stages and 16-byte alignments, and
each fits in an SM's shared memory; on a machine without a GPU (tests/sm90_compile.py says why).
Shared memory is what only the compiled kernel reveals: the stages multiply it for the largest
(prefill) GEMM tiles, and the alignment's scans over its one-hot matrix take it too."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvship.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

# As a script, in a child process: sm90_compile must import triton with the interpreter off.
SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sm90_compile  # first: it turns the interpreter off before triton is imported
from triton import compile as triton_compile
from triton.compiler import ASTSource
from kvship.kernels import fused_moe

SMEM_SM90 = 232448  # bytes of shared memory one block may take on sm_90
for spec in json.loads(sys.argv[2]):
    kernel = getattr(fused_moe, spec["kernel"])
    constexprs = sm90_compile.with_defaults(kernel, spec["constexprs"])
    sig = {n: ("constexpr" if n in constexprs else spec["types"][n]) for n in kernel.arg_names}
    # what a launch tells the compiler of 16-aligned pointers and sizes: it pipelines the loads
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec["aligned"]}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    out = triton_compile(src, target=sm90_compile.SM90, options=spec["options"])
    assert out.metadata.shared <= SMEM_SM90, (spec, out.metadata.shared)
    print("ok", spec["kernel"], spec["constexprs"], spec["options"], out.metadata.shared)
"""


def _route_and_align_specs():
    for dtype, experts, top_k in (("bf16", 128, 8), ("fp32", 128, 8), ("bf16", 8, 2), ("bf16", 512, 8)):
        yield {"kernel": "_route_kernel", "aligned": [],
               "types": {"logits_ptr": f"*{dtype}", "weights_ptr": "*fp32", "ids_ptr": "*i64", "num_experts": "i32",
                         "stride_l": "i32"},
               "constexprs": {"TOP_K": top_k, "RENORMALIZE": True, "E_POW2": experts, "K_POW2": top_k},
               "options": {"num_warps": 1 if experts <= 256 else 4}}
    # DeepSeek-V3's routing (256 experts in 8 groups, 4 kept, top 8) and Moonlight's (64, one group, top 6)
    for groups, experts, kept, top_k in ((8, 256, 4, 8), (1, 64, 1, 6)):
        yield {"kernel": "_noaux_route_kernel", "aligned": [],
               "types": {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                         "stride_l": "i32", "scaling": "fp32"},
               "constexprs": {"N_GROUP": groups, "PER_GROUP": experts // groups, "TOPK_GROUP": kept, "TOP_K": top_k,
                              "K_POW2": 1 << (top_k - 1).bit_length(), "RENORMALIZE": True},
               "options": {"num_warps": 1}}
    # the largest one-hot matrices align_by_expert hands the kernel, for E = 128 (Qwen3-30B-A3B at
    # 32 decode tokens and at 1), 8 (Mixtral, 2048 tokens) and 512
    for pairs, experts, block_m in ((256, 128, 16), (8, 128, 16), (4096, 8, 128), (64, 512, 16)):
        blocks = -(-(pairs + min(experts, pairs) * (block_m - 1)) // block_m)
        yield {"kernel": "_align_kernel", "aligned": [],
               "types": {"ids_ptr": "*i64", "sorted_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32",
                         "num_pairs": "i32", "num_blocks": "i32"},
               "constexprs": {"BLOCK_M": block_m, "P_POW2": pairs, "E_POW2": experts,
                              "B_POW2": 1 << (blocks - 1).bit_length(), "FILL": 1024},
               "options": {"num_warps": 8}}


def _specs():
    from kvship.kernels.fused_moe import GEMV_DOWN, GEMV_GATE_UP, moe_config

    yield from _route_and_align_specs()

    # storage: 16-bit experts (the scale pointers are the weights', never read), FP8 codes (their
    # bytes) with a scale per row or per 128 x 128 block, and integer codes: Q4_K (4 bits in
    # groups of 32 with offsets), Q6_K (8-bit containers, symmetric, groups of 16), in-situ int8
    # (a scale per row) and int4 (groups of 128 with offsets)
    storage = [dict(w="bf16", s="*bf16", FP8=False, INT=False, PACK=1, SYMM=False, CENTRE=0.0, GROUP=0),
               dict(w="u8", s="*fp32", FP8=True, INT=False, PACK=1, SYMM=False, CENTRE=0.0, GROUP=0),
               dict(w="u8", s="*fp32", FP8=True, INT=False, PACK=1, SYMM=False, CENTRE=0.0, GROUP=128),
               dict(w="u8", s="*fp16", FP8=False, INT=True, PACK=2, SYMM=False, CENTRE=0.0, GROUP=32),
               dict(w="u8", s="*fp16", FP8=False, INT=True, PACK=1, SYMM=True, CENTRE=128.0, GROUP=16),
               dict(w="u8", s="*fp16", FP8=False, INT=True, PACK=1, SYMM=True, CENTRE=128.0, GROUP=0),
               dict(w="u8", s="*fp16", FP8=False, INT=True, PACK=2, SYMM=False, CENTRE=0.0, GROUP=128)]
    tiles = {moe_config(t, 8, 128) for t in (1, 300, 1024, 4096)}
    for cfg in sorted(tiles, key=lambda c: c.block_m):
        for gated in (True, False):
            for dtype, st in [("bf16", st) for st in storage] + (
                    [("fp32", storage[0])] if cfg.block_m == 16 else []):  # fp32: --dtype float32
                w = f"*{dtype}" if st["w"] == "bf16" else "*u8"
                s = f"*{dtype}" if st["w"] == "bf16" else st["s"]
                flags = {k: v for k, v in st.items() if k not in ("w", "s")}
                fp8_group = st["GROUP"] if st["FP8"] else 0
                types = {"a_ptr": f"*{dtype}", "w_ptr": w, "s_ptr": s, "b_ptr": s, "out_ptr": f"*{dtype}",
                         "rw_ptr": "*fp32", "sorted_ptr": "*i32", "experts_ptr": "*i32", "padded_ptr": "*i32"}
                types |= dict.fromkeys(("num_pairs", "N", "K", "ngroups", "stride_a", "stride_we", "stride_wn",
                                        "stride_se", "stride_sn", "stride_out"), "i32")
                # Qwen3-30B-A3B: H 2048, I 768
                aligned = [n for n in types if n not in ("num_pairs", "ngroups", "stride_sn")]
                yield {"kernel": "_moe_gemm_kernel", "types": types, "aligned": aligned,
                       "constexprs": {"A_DIV": 8 if gated else 1, "GATED": gated, "SCALE": not gated, **flags,
                                      "BLOCK_M": cfg.block_m,
                                      "BLOCK_N": max(16, cfg.block_n // 2) if gated else cfg.block_n,
                                      "BLOCK_K": min(cfg.block_k, fp8_group) if fp8_group else cfg.block_k},
                       "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}}
    for st in storage:  # the one-token kernels at their launch settings
        w, s = ("*bf16", "*bf16") if st["w"] == "bf16" else ("*u8", st["s"])
        flags = {k: v for k, v in st.items() if k not in ("w", "s")}
        for kernel, launch, ptrs, strides in (
                ("_gemv_gate_up_kernel", GEMV_GATE_UP, {"x_ptr": "*bf16", "w_ptr": w, "s_ptr": s, "b_ptr": s,
                                                         "ids_ptr": "*i64", "h_ptr": "*bf16"}, ("stride_x", "stride_h")),
                ("_gemv_down_kernel", GEMV_DOWN, {"h_ptr": "*bf16", "w_ptr": w, "s_ptr": s, "b_ptr": s,
                                                  "ids_ptr": "*i64", "rw_ptr": "*fp32", "add_ptr": "*bf16",
                                                  "out_ptr": "*bf16"},
                 ("stride_h", "stride_add", "stride_out"))):
            types = ptrs | dict.fromkeys(("N", "K", "ngroups", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                          *strides), "i32")
            yield {"kernel": kernel, "types": types,
                   "aligned": [n for n in types if n not in ("ngroups", "stride_sn", "ids_ptr", "rw_ptr")],
                   "constexprs": {"TOP_K": 8, **flags, "BLOCK_N": launch["block_n"],
                                  "BLOCK_K": max(launch["block_k"], st["GROUP"]),
                                  # DeepSeek's down kernel adds its shared experts' output
                                  **({"BLOCK_J": 8, "ADD": True} if kernel == "_gemv_down_kernel" else {})},
                   "options": {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}}


@pytest.mark.timeout(900)
def test_fused_moe_compiles_for_sm90():
    specs = list(_specs())
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(Path(__file__).parents[1]), json.dumps(specs)],
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == len(specs)
