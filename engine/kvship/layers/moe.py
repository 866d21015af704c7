"""Mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's
top-k experts, each a SwiGLU MLP, and their outputs are summed with the router's weights.

Experts are stacked so that one parameter holds every expert's matrix: w13 [E, 2 * I, H] (gate
rows, then up rows) and w2 [E, H, I]. Tensor parallelism shards each expert's intermediate
dimension, like the dense MLP: every rank routes the same way (the router is replicated) and
returns partial sums that the next norm reduces.

The router's choice (``route``: softmax, top k, renormalized for Mixtral and Qwen3-MoE's
norm_topk_prob) and the experts run in kernels/fused_moe.py: on a GPU, its Triton kernels (shapes
fixed by the token count, no host sync, so decode runs in CUDA graphs); elsewhere its plain-torch
path, one matmul pair per expert that has tokens. Both read only the selected experts' weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.kernels.fused_moe import fused_moe, route
from kvship.parallel import TPContext

__all__ = ["MoEExperts", "moe_reference", "route"]  # the models take route from here


class MoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.intermediate = tp.shard(intermediate, "moe intermediate size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.intermediate), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, ref, shard_id: tuple[int, int | None]) -> None:
        """shard_id: (expert, 0 for gate / 1 for up) for w13; (expert, None) for w2 (down)."""
        expert, part = shard_id
        size, start = self.intermediate, self.tp.rank * self.intermediate
        if part is None:  # down: [H, I], this rank's columns
            param.data[expert].copy_(ref.load((slice(None), slice(start, start + size))))
        else:  # gate or up: [I, H], this rank's rows
            param.data[expert, part * size:(part + 1) * size].copy_(ref.load((slice(start, start + size),)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing (weights, ids) [T, k] -> this rank's partial sums [T, H]."""
        return fused_moe(x, self.w13, self.w2, weights, ids)


def moe_reference(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    """Token by token, expert by expert: what MoEExperts computes, written as the definition."""
    weights, ids = route(x @ router.T, top_k, renormalize)
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out
