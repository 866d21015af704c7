"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvship.parallel import TPContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)
        # Padded to shard_size so every rank's shard has the same shape (needed by all_gather).
        self.weight = nn.Parameter(torch.zeros(self.shard_size, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, ref, shard_id=None) -> None:
        rows = ref.load((slice(self.start, self.end),))
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; shares the embedding's weight when tied."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
