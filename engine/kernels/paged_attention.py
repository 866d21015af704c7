"""Attention over a paged KV cache.

Cache layout (one pair per layer): k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block block_table[t // block_size], row t % block_size; its
"slot" is block_id * block_size + row.

Batch layout: the new tokens of all sequences are flattened, q: [T, Hq, D];
cu_seqlens_q [B+1] delimits each sequence's tokens; seq_lens [B] is each sequence's context
length *including* the new tokens (already stored in the cache); block_tables [B, max_blocks].
New token i of sequence b sits at position seq_lens[b] - q_len[b] + i and attends causally to
positions <= its own. Decode is the case q_len == 1 for every sequence.

This file holds the plain-torch reference (CPU path, and the oracle for the Triton kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new keys/values [T, Hkv, D] into their slots; slot -1 means padding (skipped)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    starts = cu_seqlens_q.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1)  # [Hq, q_len, D]
        kb = gather_kv(k_cache, block_tables[b], ctx).transpose(0, 1).to(q.dtype)
        vb = gather_kv(v_cache, block_tables[b], ctx).transpose(0, 1).to(q.dtype)
        if group > 1:
            kb = kb.repeat_interleave(group, dim=0)
            vb = vb.repeat_interleave(group, dim=0)
        q_len = e - s
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # causal with a cached prefix
        ob = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), attn_mask=mask, scale=scale)
        out[s:e] = ob.transpose(0, 1).to(q.dtype)
    return out
