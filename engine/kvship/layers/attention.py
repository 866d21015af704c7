"""Attention over the paged KV cache; the batch's layout travels in AttentionMetadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvship.kernels import paged_attention as pa
from kvship.kernels.rotary import rotary_store_kv, rotary_store_kv_torch
from kvship.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. the new tokens
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled


class PagedAttention(nn.Module):
    """Rotary embedding, the KV-cache store and attention: the first two fused on the GPU."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.rotary = rotary
        self.force_torch = backend == "torch"
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D], not yet rotated -> attention output [T, Hq, D]."""
        store = (self.rotary.cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping)
        args = (self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale)
        if self.force_torch:
            q = rotary_store_kv_torch(positions, q, k, v, *store)
            return pa.paged_attention_torch(q, *args)
        q = rotary_store_kv(positions, q, k, v, *store)
        return pa.paged_attention(q, *args, meta.max_seqlen_q)
