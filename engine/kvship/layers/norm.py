"""RMSNorm, optionally fused with the residual add (Llama's pre-norm blocks) and, at TP > 1, with
the all-reduce of the row-parallel linear before it."""
from __future__ import annotations

import torch
from torch import nn

from kvship.kernels.norm import fused_add_rms_norm, rms_norm
from kvship.parallel import TPContext


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, reduce_tp: TPContext | None = None, site: int = 0):
        """With ``reduce_tp`` (size > 1), an ``x`` passed with a residual holds this rank's partial
        sums, reduced here. ``site`` numbers such norms in the order a forward reaches them: the
        fused kernel alternates buffer slots by it, so two consecutive ones must differ by an odd
        number (also from the last of one forward to the first of the next)."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.reduce_tp = reduce_tp if reduce_tp is not None and reduce_tp.size > 1 else None
        self.site = site

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With a residual: (norm(x + residual), x + residual), x summed over ranks first."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        tp = self.reduce_tp
        if tp is not None:
            fused = tp.fused_norm
            if fused is not None and fused.applies(x, residual):
                return fused(x, residual, self.weight, self.eps, self.site)
            x = tp.all_reduce(x)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
