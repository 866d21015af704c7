"""The block-wise FP8 GEMM (kernels/fp8_matmul.py)."""


def _cfg(block_m: int, block_n: int, num_warps: int, num_stages: int) -> dict[str, int]:
    return {"block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "group_m": 8}


# Tuned on sm_90 with `python bench/fp8_gemm.py --sweep` over the Llama-3-8B projections.
#
# Tiles by row count (up to 16, up to 64, more). Each group's dot is scaled before the
# next, so the tensor cores wait every step and wide tiles gain less than in a plain GEMM. Down
# keeps 64-row tiles at 64 rows: narrower ones did not hold up when timed again.
GROUP_GEMM_CONFIGS = {16: _cfg(16, 64, 4, 4), 64: _cfg(64, 64, 4, 4), 256: _cfg(64, 128, 8, 3)}
GROUP_GEMM_SHAPES = {
    (6144, 4096): {16: _cfg(16, 64, 4, 4), 64: _cfg(64, 64, 4, 4), 256: _cfg(64, 64, 4, 3)},
    (4096, 4096): {16: _cfg(16, 64, 4, 4), 64: _cfg(64, 64, 4, 4), 256: _cfg(64, 128, 8, 3)},
    (28672, 4096): {16: _cfg(16, 128, 4, 3), 64: _cfg(64, 128, 4, 3), 256: _cfg(128, 64, 4, 3)},
    (4096, 14336): {16: _cfg(16, 64, 4, 4), 64: _cfg(64, 64, 4, 4), 256: _cfg(64, 128, 8, 3)},
}
