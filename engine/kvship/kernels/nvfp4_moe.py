"""Routed experts in NVFP4 (W4A16): x [T, H], the router's choice (weights, ids) [T, k] and
stacked codes w13 [E, 2I, H / 2] (gate rows, then up rows) and w2 [E, H, I / 2], two e2m1 codes
a byte (the even input in the low nibble), with float32 scales [E, N, K / 16] (the FP8 block
scale times the global factor, kvship.quant.nvfp4) -> sum over the k choices of
weight * w2[e] @ (silu(gate) * up), as kernels/fused_moe.py computes for other storage.

The experts stay 4-bit on the device: fused_moe's alignment by expert (shapes fixed by (T, k, E):
CUDA-graph safe), then one grouped GEMM for w13 with SiLU-and-mul in its epilogue and one for w2
scaled by the router weights, each decoding its weight tiles in registers (kernels/packed_moe.py,
kernels/fp4.py) and multiplying in the activations' dtype. One token takes ``nvfp4_moe_gemv`` instead: a program per
(pair, row tile) of FMAs in fp32, no alignment or padded rows. The reference and CPU path is
fused_moe_torch, which dequantizes each chosen expert."""
from __future__ import annotations

import torch

from kvship.kernels._triton import use_triton
from kvship.kernels.fused_moe import ExpertScales, MoEConfig, fused_moe_torch, moe_config
from kvship.kernels.packed_moe import PackedExperts, packed_moe_gemm, packed_moe_gemv
from kvship.kernels.tuning.moe import NVFP4_GEMV_DOWN as GEMV_DOWN
from kvship.kernels.tuning.moe import NVFP4_GEMV_GATE_UP as GEMV_GATE_UP


def nvfp4_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   scales: ExpertScales, add: torch.Tensor | None = None, gate_up: dict | None = None,
                   down: dict | None = None) -> torch.Tensor:
    """nvfp4_moe_triton's result by the GEMV kernel, a program per (pair, BLOCK_N rows)."""
    out = packed_moe_gemv(x, _packed(w13, w2, scales), weights, ids, gate_up or GEMV_GATE_UP, down or GEMV_DOWN)
    return out if add is None else out + add


def _packed(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales) -> PackedExperts:
    """The stacks as kernels/packed_moe.py reads them: no biases, SiLU-and-mul."""
    return PackedExperts(w13, w2, "nvfp4", "silu_mul", scales.w13, scales.w2)


def nvfp4_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     scales: ExpertScales, add: torch.Tensor | None = None, config: MoEConfig | None = None
                     ) -> torch.Tensor:
    """The two grouped GEMMs, then the k rows of each token summed; for one token (and no tiles
    asked for) ``nvfp4_moe_gemv``."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    if config is None and tokens == 1:
        return nvfp4_moe_gemv(x, w13, w2, weights, ids, scales, add)
    cfg = config or moe_config(tokens, top_k, w13.shape[0])
    out = packed_moe_gemm(x, _packed(w13, w2, scales), weights, ids, cfg)
    return out if add is None else out + add


def nvfp4_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              scales: ExpertScales, add: torch.Tensor | None = None) -> torch.Tensor:
    """``scales``: the stacks' float32 scales per 16 inputs (``e2m1`` set); ``add``: a tensor like
    x added to the result (a shared expert's output)."""
    if use_triton(x):
        return nvfp4_moe_triton(x, w13, w2, weights, ids, scales, add)
    return fused_moe_torch(x, w13, w2, weights, ids, scales, add)
