"""The fused mixture-of-experts kernels (kernels/fused_moe.py)."""

# Tuned on sm_90 with `python bench/moe_sweep.py` at Qwen3-30B-A3B's sizes.
#
# One token: the two GEMV kernels (from 4 tokens the grouped GEMMs win). The down kernel's tile
# holds all top-k experts' rows, in K tiles of 256 that divide the 768 inputs.
GEMV_GATE_UP = {"block_n": 8, "block_k": 512, "num_warps": 2, "num_stages": 3}
GEMV_DOWN = {"block_n": 4, "block_k": 256, "num_warps": 2, "num_stages": 3}
# gpt-oss's one-token GEMV for 16-bit experts (kernels/gpt_oss_moe.py): untuned starting points
GPT_OSS_GEMV_GATE_UP = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3}
GPT_OSS_GEMV_DOWN = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3}
# NVFP4 experts' one-token GEMV (kernels/nvfp4_moe.py): untuned starting points (bench/nvfp4_moe.py times them)
NVFP4_GEMV_GATE_UP = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3}
NVFP4_GEMV_DOWN = {"block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 3}
# gpt-oss's MXFP4 experts for few tokens (kernels/mxfp4_gemv.py), tuned on sm_90 with
# `python bench/moe_sweep.py --mxfp4 --tokens 1 4 16` at gpt-oss-20b's sizes:
# (tokens up to, gate/up settings, down settings); more tokens take the grouped GEMMs. A program
# holds block_n rows x block_g groups of 32 inputs of the gate and the up projection (gate/up),
# or of each of a token's k experts (down); 'pairs' decodes a word's codes as float16 pairs.
# The down settings were swept when a down program looped over the k experts; since its tile
# holds all k, block_n is the swept one divided by k (the same bytes a thread; one token: kept,
# 4 slots a thread), until re-swept. 'x_words' (inputs as pair words, made once) was timed against
# the same settings without it: a loss at 1 token (one launch more), a win at 4 (docs/performance.md).
MXFP4_GEMV = (
    (1, {"block_n": 4, "block_g": 32, "num_warps": 4, "pairs": 1}, {"block_n": 4, "block_g": 32, "num_warps": 4, "pairs": 1}),
    (4, {"block_n": 4, "block_g": 8, "num_warps": 1, "pairs": 1, "x_words": 1},
     {"block_n": 4, "block_g": 32, "num_warps": 4, "pairs": 1, "x_words": 1}),
    (16, {"block_n": 16, "block_g": 4, "num_warps": 1, "pairs": 1}, {"block_n": 4, "block_g": 32, "num_warps": 4, "pairs": 1}),
)

# The grouped GEMMs' tiles (block_m, block_n, block_k, num_warps, num_stages) by the pairs each
# expert gets on average, up to each bound (None: any more). Few pairs (decode): narrow tiles,
# many programs streaming the chosen experts; many (prefill): large tiles for the tensor cores.
# Near vLLM's tuned tables for 128 experts of 768.
MOE_TILES = ((8, (16, 64, 128, 4, 3)), (32, (32, 128, 64, 4, 3)), (128, (64, 128, 64, 4, 3)),
             (None, (128, 256, 64, 8, 3)))
