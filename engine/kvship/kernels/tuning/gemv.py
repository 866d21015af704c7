"""The 16-bit one-row GEMV (kernels/gemv.py)."""

# Tuned on sm_90 with `python bench/gemv_sweep.py [--more | --deepseek | --absorbed]`.
#
# (N, K) -> settings, only for shapes where the kernel beat cuBLAS at one row inside a CUDA
# graph; every other shape stays on cuBLAS.
GEMV_SHAPES: dict[tuple[int, int], dict[str, int]] = {
    # Llama-3-8B q/k/v, o, down (gate/up: cuBLAS already reads it at copy bandwidth)
    (6144, 4096): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3},
    (4096, 4096): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 1},
    (4096, 14336): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3},
    # its TP=2 rank slices
    (3072, 4096): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3},
    (4096, 2048): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 1},
    (4096, 7168): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3},
    # Qwen3-30B-A3B q/k/v, o and router (its MLPs are experts: kernels/fused_moe.py)
    (5120, 2048): {"block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 1},
    (2048, 4096): {"block_n": 8, "block_k": 2048, "num_warps": 8, "num_stages": 1},
    (128, 2048): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3},
    # Gemma-2-9B o, down (q/k/v and gate/up: cuBLAS as fast in the engine)
    (3584, 4096): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3},
    (3584, 14336): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 3},
    # Phi-4 o, down (q/k/v: a tie)
    (5120, 5120): {"block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 1},
    (5120, 17920): {"block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 1},
    # DeepSeek-V2-Lite and Moonlight: q, latent (kv_a), o, shared experts' gate/up and down,
    # the first layer's dense down
    (3072, 2048): {"block_n": 8, "block_k": 1024, "num_warps": 8, "num_stages": 1},
    (576, 2048): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 1},
    (2048, 2048): {"block_n": 8, "block_k": 2048, "num_warps": 8, "num_stages": 1},
    (5632, 2048): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 1},
    (2048, 2816): {"block_n": 8, "block_k": 2048, "num_warps": 8, "num_stages": 3},
    (21888, 2048): {"block_n": 8, "block_k": 1024, "num_warps": 2, "num_stages": 1},
    (2048, 10944): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3},
    (2048, 11264): {"block_n": 8, "block_k": 2048, "num_warps": 4, "num_stages": 3},
}
DEFAULT_CONFIG = {"block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3}  # a call that names none

# float_linear (DeepSeek's float32 router, 64 rows of 2048): each row read in one pass.
FLOAT_GEMV_CONFIG = {"block_n": 2, "block_k": 2048, "num_warps": 4, "num_stages": 1}

# head_gemv_triton by orientation (transposed or not): DeepSeek's absorbed W_UK and W_UV products.
HEAD_GEMV_CONFIG = {False: {"block_n": 8, "block_k": 512, "num_warps": 8},
                    True: {"block_n": 32, "block_k": 128, "num_warps": 2}}
