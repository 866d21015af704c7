"""What the paged attention kernels' main loops ask of an H100/H200's SMs, read from their sm_90
machine code on any machine (no GPU): each kernel is compiled as the engine launches it
(Llama-3-8B's heads: 32 query heads, 8 KV heads, head size 128, pages of 16 tokens), and each
loop's SASS is counted. "per KV byte" divides a loop's thread-instructions by the key and value
bytes one iteration reads, in the cache's layout.

Why it matters: a decode loop that needs more than about 7 instructions a KV byte cannot keep
up with memory on an H200 (bench/sass.py says why). Registers and spills come from ptxas.

    python bench/sass_attention.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiling for a target, not interpreting
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import torch  # noqa: E402

from common import header, table  # noqa: E402
from kvship.kernels import paged_attention as pa  # noqa: E402
from sass import loops, registers  # noqa: E402
from sm90_compile import attention_types, compile_sm90, decode_types  # noqa: E402

LAYOUTS = {"bf16": ("*bf16", "*bf16", 0, 2.0), "fp8": ("*fp8e4nv", "*fp32", 1, 1.0), "int4": ("*u8", "*fp16", 2, 0.5)}
DIVISIBLE = ["q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "mid_o_ptr", "mid_lse_ptr", "stride_qt", "stride_qh",
             "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_ot", "stride_oh"]


def main() -> None:
    rows = []
    for name, (cache, scales, mode, elem) in LAYOUTS.items():
        cfg = pa.DECODE_CONFIGS[mode]
        decode = compile_sm90(pa._decode_kernel, decode_types(cache, scales),
                              dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, NUM_SPLITS=8,
                                   KV_MODE=mode, BLOCK_N=cfg["block_n"],
                                   PACKED=pa.packed_read(cfg, mode, torch.bfloat16, 128)),
                              DIVISIBLE, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
        pre = pa.PREFILL_CONFIG[128]
        prefill = compile_sm90(pa._prefill_kernel, attention_types(cache, scales),
                               dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=pre["block_m"],
                                    BLOCK_N=pre["block_n"], KV_MODE=mode),
                               [d for d in DIVISIBLE if not d.startswith("mid")],
                               {"num_warps": pre["num_warps"], "num_stages": pre["num_stages"]})
        for kernel, compiled, block_n, warps in (("decode", decode, cfg["block_n"], cfg["num_warps"]),
                                                 ("prefill", prefill, pre["block_n"], pre["num_warps"])):
            kv_bytes = block_n * 128 * 2 * elem  # one iteration: one tile of keys and values of one KV head
            found = loops(compiled.asm["cubin"])[:2]
            for i, ops in enumerate(found):  # largest first
                n = sum(ops.values())
                top = ", ".join(f"{op} {k}" for op, k in ops.most_common(6))
                # prefill runs the tiles below the diagonal unmasked, those on it masked (the mask's
                # compares and selects make that loop the larger)
                part = "" if len(found) == 1 else " (masked tiles)" if i == 0 else " (unmasked tiles)"
                rows.append([f"{kernel} {name}{part}", str(block_n), str(n),
                             f"{n * 32 * warps / kv_bytes:.2f}", registers(compiled.asm["ptx"]), top])
    print(header("Paged attention main loops in sm_90 SASS, Llama-3-8B heads, pages of 16 tokens"))
    print(table(rows, ["kernel, KV layout", "tile tokens", "warp instructions", "per KV byte",
                       "registers / spilled bytes", "most frequent"]))


if __name__ == "__main__":
    main()
