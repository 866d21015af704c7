"""What the quantized one-row GEMV (kernels/quant_gemv.py's pairs kernel) asks of an H100/H200's
SMs, read from its sm_90 machine code on any machine (no GPU): compiled for each format at the
engine's settings for each Llama-3-8B projection (kernels/tuning/quant_linear.py), its main
loop's SASS counted. "per weight byte" divides the loop's thread-instructions by the code bytes
one iteration reads. Below about 7 (bench/sass.py says why) the loop's instructions are not
what holds the kernel under copy bandwidth.

    python bench/sass_gemv.py
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiling for a target, not interpreting
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from common import header, table  # noqa: E402
from kvship.kernels import quant_gemv as qg  # noqa: E402
from kvship.kernels import quant_linear as ql  # noqa: E402
from sass import loops, registers  # noqa: E402
from sm90_compile import compile_sm90, ints  # noqa: E402

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
# name: (bits, FP8, symmetric, group) as the formats load: GPTQ/AWQ-style int4 in groups of 128,
# Q4_K's layout (groups of 32 with offsets), per-row int8 (in-situ), per-row FP8
FORMATS = {"int4 g128": (4, False, True, 128), "int4 g32 (Q4_K)": (4, False, False, 32),
           "int8": (8, False, True, 0), "fp8": (8, True, True, 0)}
DIVISIBLE = ["x_ptr", "w_ptr", "s_ptr", "b_ptr", "y_ptr", "stride_w", "stride_s", "KW"]


def main() -> None:
    rows = []
    for fmt, (bits, fp8, symm, group) in FORMATS.items():
        scales = "*fp32" if fp8 else "*fp16"
        types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": scales, "b_ptr": scales, "bias_ptr": "*bf16",
                 "y_ptr": "*bf16", **ints("N", "KW", "stride_w", "stride_s", "ngroups")}
        for shape, (n, k) in SHAPES.items():
            key = ("fp8" if fp8 else bits, group, n, k)
            cfg = ql.PAIRS_GEMV_SHAPES.get(key, ql.PAIRS_GEMV_CONFIGS[key[0]])
            kw = k * bits // 32
            compiled = compile_sm90(
                qg._qgemv_pairs_kernel, types,
                dict(BITS=bits, FP8=fp8, SYMM=symm, HAS_BIAS=False, G=group or 1 << 30,
                     CODE_SHIFT=qg.CODE_SHIFT[bits, fp8], ASM=True,
                     EVEN=n % cfg["block_n"] == 0 and kw % cfg["block_w"] == 0,
                     BLOCK_N=cfg["block_n"], BLOCK_W=cfg["block_w"], PDL=True),
                DIVISIBLE, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
            ops = loops(compiled.asm["cubin"])[0]
            count = sum(ops.values())
            tile_bytes = cfg["block_n"] * cfg["block_w"] * 4
            rows.append([fmt, shape, f"{cfg['block_n']} x {cfg['block_w']}, {cfg['num_warps']} warps", str(count),
                         f"{count * 32 * cfg['num_warps'] / tile_bytes:.2f}", registers(compiled.asm["ptx"]),
                         ", ".join(f"{op} {c}" for op, c in ops.most_common(5))])
    print(header("Quantized one-row GEMV (pairs kernel) main loop in sm_90 SASS, Llama-3-8B projections"))
    print(table(rows, ["format", "projection", "tile (rows x words), warps", "warp instructions",
                       "per weight byte", "registers / spilled bytes", "most frequent"]))


if __name__ == "__main__":
    main()
