"""Quantized linear layers (kernels/quant_linear.py, quant_gemv.py, quant_gemv_mma.py)."""

# Tuned on sm_90 with `python bench/quant_gemv_sweep.py --formats <fmt> [--tokens 2 4 8 16]` over
# the Llama-3-8B projections.
#
# One row, per-code kernel (FP8 beside a float32 x, or layouts no other kernel takes), by bits.
GEMV_CONFIGS = {8: {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 3},
                4: {"block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 3}}
# One row, word kernel (integer codes beside a float32 x, or layouts the pairs kernel leaves).
WORD_GEMV_CONFIGS = {8: {"block_n": 8, "block_w": 512, "num_warps": 4, "num_stages": 3},
                     4: {"block_n": 16, "block_w": 256, "num_warps": 8, "num_stages": 3}}


def _pairs(block_n: int, block_w: int, num_warps: int) -> dict[str, int]:
    """A setting of the fp16-pair kernel (swept at 3 stages only)."""
    return {"pairs": 1, "block_n": block_n, "block_w": block_w, "num_warps": num_warps, "num_stages": 3}


# One row beside a 16-bit x, fp16-pair kernel (the fastest one-row kernel for every format),
# by format ("fp8" or bits). One setting a format keeps the dispatch simple; the shapes below
# are the ones where another setting won clearly.
PAIRS_GEMV_CONFIGS = {8: _pairs(8, 512, 4), 4: _pairs(8, 256, 4), "fp8": _pairs(8, 512, 4)}
# (format, group, N, K) -> setting (group: inputs a scale covers, 0 for one a row).
_INT4_8B = {(6144, 4096): _pairs(16, 256, 4), (4096, 4096): _pairs(8, 512, 4), (28672, 4096): _pairs(8, 256, 2),
            (4096, 14336): _pairs(8, 512, 4)}
PAIRS_GEMV_SHAPES = {
    **{(4, group, n, k): cfg for group in (128, 32) for (n, k), cfg in _INT4_8B.items()},
    ("fp8", 0, 6144, 4096): _pairs(8, 256, 4), ("fp8", 0, 4096, 4096): _pairs(8, 256, 8),
    ("fp8", 0, 28672, 4096): _pairs(32, 64, 4), ("fp8", 0, 4096, 14336): _pairs(16, 512, 8),
}

# 2 to 8 rows of 4-bit codes in groups of 128 (or one a row): the tensor-core GEMV reads the
# weights once where the dequantizing GEMM took about twice as long. One row stays on the pairs
# kernel, which reads closer to copy bandwidth.
MMA_GEMV_CONFIG = {"mma": 1, "rows": 16, "num_warps": 4}
MMA_GEMV_SHAPES = {(4, 128, 28672, 4096): {"mma": 1, "rows": 32, "num_warps": 2},
                   (4, 128, 4096, 14336): {"mma": 1, "rows": 16, "num_warps": 8}}

# From this many rows the matrix goes to cuBLAS (expanded to 16 bits) or the FP8 tensor cores:
# the dequantizing GEMM fell several times behind cuBLAS from 16 rows.
DENSE_ROWS = 16
# FP8 weights take W8A8 from two rows: faster than the dequantizing GEMM on every 8B projection.
W8A8_ROWS = 2

# The dequantizing GEMM below DENSE_ROWS (and wherever a caller asks for it), by row count.
GEMM_CONFIGS = {16: {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
                64: {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3},
                None: {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}}
