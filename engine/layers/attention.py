"""Attention over the paged KV cache; the batch's layout travels in AttentionMetadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvship.kernels import paged_attention as pa


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. the new tokens
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.force_torch = backend == "torch"
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        args = (self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale)
        if self.force_torch:
            pa.store_kv_torch(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return pa.paged_attention_torch(q, *args)
        pa.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return pa.paged_attention(q, *args, meta.max_seqlen_q)
