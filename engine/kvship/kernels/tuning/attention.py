"""Paged attention (kernels/paged_attention.py, kernels/mla_attention.py)."""
from kvship.kernels.kv_quant import KV_FP8, KV_INT4, KV_PLAIN

# Tuned on sm_90 with `python bench/kv_attention_sweep.py` (decode) and `python bench/kernels_gpu.py
# --prefill-sweep` (prefill).
#
# Decode, by the cache's layout (kv_quant.KV_*). "waves": rounds of programs over the SMs that
# the context splits aim for; "packed": how quantized pages are read (paged_attention.packed_read).
# FP8 reads values packed and keys as the compiler lays them out; int4 reads its even and odd
# channels apart ("split"). Larger quantized tiles read each block's scales for more tokens at
# once, which pays at the batches that fill the GPU. More than 4 stages double-buffer a tile,
# which did not pay.
DECODE_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 4, "max_splits": 64}
DECODE_CONFIGS = {KV_PLAIN: DECODE_CONFIG,
                  KV_FP8: {"block_n": 128, "num_warps": 4, "num_stages": 3, "waves": 8, "max_splits": 64,
                           "packed": "values"},
                  KV_INT4: {"block_n": 128, "num_warps": 4, "num_stages": 3, "waves": 4, "max_splits": 64,
                            "packed": "split"}}

# Prefill, by head size (others take 128's).
PREFILL_CONFIG = {
    64: {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3},
    128: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3},
}

# Latent attention (DeepSeek's MLA), tuned on sm_90 with `python bench/mla_sweep.py --quick`.
# Tiles of 32 rows keep the 512-wide latent tile double-buffered in shared memory; one wave of
# programs beat four at large batches, and batch 1 still gets its 64 splits.
MLA_DECODE_CONFIG = {"block_n": 32, "block_h": 16, "num_warps": 4, "num_stages": 2, "waves": 1, "max_splits": 64}
# 16 tokens of one head (a dot's fewest rows): a [16, 512] fp32 accumulator at 4 warps stays
# well under the register limit, where 32 tokens would spill. Not tuned.
MLA_PREFILL_CONFIG = {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
