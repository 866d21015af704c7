"""RMSNorm, optionally fused with the residual add (Llama's pre-norm blocks)."""
from __future__ import annotations

import torch
from torch import nn

from kvship.kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
