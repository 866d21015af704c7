"""RMSNorm, optionally fused with the residual add (Llama's pre-norm blocks) and, at TP > 1, with
the all-reduce of the row-parallel linear before it; or deferred (``RMSNorm.defer``) to the
projection that consumes it, whose one-row GEMV kernel takes the norm in (kernels/gemv.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvship.kernels.gemv import PreNorm, norm_linear
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

    def defer(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> "PendingNorm":
        """This norm of x (+ residual), left for the projection after it to apply."""
        return PendingNorm(self, x, residual)


@dataclass(frozen=True)
class PendingNorm:
    """A decoder block's input norm, not yet applied: ``apply`` runs it, ``linear`` hands it to a
    16-bit projection's GEMV kernel where that kernel would run (one row, in a CUDA graph, a
    listed shape) and the norm needs no all-reduce, and ``then`` applies it before any other
    sublayer. Each returns the new residual beside its result: x + residual, or x when there is
    no residual yet (the first layer)."""

    norm: RMSNorm
    x: torch.Tensor
    residual: torch.Tensor | None

    def apply(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalized input, new residual)."""
        if self.residual is None:
            return self.norm(self.x), self.x
        return self.norm(self.x, self.residual)

    def then(self, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer(normalized input), new residual)."""
        normed, residual = self.apply()
        return sublayer(normed), residual

    def prenorm(self) -> PreNorm | None:
        """The norm as a kernel takes it in; None where it needs an all-reduce first (TP > 1)."""
        if self.norm.reduce_tp is not None:
            return None
        return PreNorm(self.norm.weight, self.norm.eps, self.residual)

    def linear(self, layer: nn.Module, keep_normed: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(layer(normalized input), new residual, normalized input) for a linear ``layer`` that
        needs no communication (kvship.layers.linear's column-parallel or replicated ones); the
        normalized input may be None unless ``keep_normed``."""
        prenorm = self.prenorm()
        if prenorm is not None and getattr(layer, "qweight", None) is None:
            return norm_linear(self.x, prenorm, layer.weight, layer.bias, keep_normed)
        normed, residual = self.apply()
        return layer(normed), residual, normed
