"""Attention over the paged KV cache; the batch's layout travels in AttentionMetadata."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from kvship.kernels import kv_quant as kvq
from kvship.kernels import mla_attention as mla
from kvship.kernels import paged_attention as pa
from kvship.kernels.norm import rms_norm_torch
from kvship.kernels.rotary import QKNorm, rotary_store_kv, rotary_store_kv_torch, rotary_torch
from kvship.layers.rotary import RotaryEmbedding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, context incl. the new tokens
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    max_seqlen_q: int
    logits_indices: torch.Tensor  # rows of the flat batch whose next token is sampled
    num_decodes: int = 0  # the first sequences with one new token each (Batch.num_decodes)
    state_slots: torch.Tensor | None = None  # [B] each sequence's recurrent-state slot (hybrid models)
    # [B] a hybrid verify step's: the state row taking a sequence's state after its first new
    # token, the next rows after the next ones but its last (-1: not kept); layers/gated_delta.py
    spec_state_rows: torch.Tensor | None = None

    @cached_property
    def query_lens(self) -> torch.Tensor:
        """[B] each sequence's new tokens, in seq_lens' dtype; computed once a step, not per layer."""
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).to(self.seq_lens.dtype)

    @cached_property
    def has_past(self) -> torch.Tensor:
        """[B] int32: 1 where a sequence had tokens computed before this step (its recurrent state
        is read), 0 for a new or recomputed one (it starts from zeros)."""
        return (self.seq_lens > self.query_lens).to(torch.int32)


# Scores held at once by the CPU path: a prefill chunk's queries are split so that one call's
# [query heads, queries, keys] stays near this many elements, whatever the prompt's length.
CPU_SCORE_ELEMENTS = 1 << 22


def _row_sinks(sinks: torch.Tensor | None, num_kv_heads: int, queries: int) -> torch.Tensor | None:
    """Each score row's sink for [Hkv, queries * group] rows (query-major): [Hkv, rows, 1]."""
    if sinks is None:
        return None
    per_head = sinks.view(num_kv_heads, 1, -1)
    return per_head.expand(num_kv_heads, queries, per_head.shape[-1]).reshape(num_kv_heads, -1, 1)


def _pages(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, head_dim: int) -> torch.Tensor:
    """kvq.pages, except that a plain cache's run of consecutive blocks (a sequence allocated in
    one go usually has one) is a view: gathering a long context copied all of it, every layer,
    every step."""
    n = blocks.numel()
    if kvq.kv_mode(cache) == kvq.KV_PLAIN and n and int(blocks[-1]) - int(blocks[0]) == n - 1 \
            and bool((blocks.diff() == 1).all()):
        return cache[int(blocks[0]) : int(blocks[0]) + n]
    return kvq.pages(cache, scales, blocks, head_dim)


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """The CPU path: each sequence attends over its own blocks only (those its queries can see),
    never a batch padded to the longest context (decodes of similar lengths excepted: padded
    to at most twice their keys, they go in one call). The query heads of a KV head stand in the query
    dimension, so keys are not repeated per head, and a long prefill chunk is split over its
    queries: memory stays linear in the context. Same inputs and result as
    kernels/paged_attention.py's ``paged_attention_torch``."""
    t, num_q_heads, d = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    same = v_cache is k_cache
    nd = 0  # the leading decodes (one query each)
    while nd < len(lens) and starts[nd + 1] - starts[nd] == 1:
        nd += 1
    if nd > 1 and nd * max(lens[:nd]) <= 2 * sum(lens[:nd]):
        # contexts of similar lengths: one padded call (at most twice their keys) beats a call
        # per sequence, whose fixed cost dominates a short decode
        out[:nd] = pa.paged_attention_torch(q[:nd], k_cache, v_cache, block_tables[:nd], seq_lens[:nd],
                                            cu_seqlens_q[: nd + 1], scale, k_scale, v_scale, window=window,
                                            softcap=softcap, sinks=sinks, chunk=chunk)
    else:
        nd = 0
    for b in range(nd, len(lens)):
        ctx = lens[b]
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len == 0:
            continue
        first = 0 if window is None else max(0, ctx - q_len - window + 1)  # the oldest key any query sees
        if chunk is not None:
            first = (ctx - q_len) - (ctx - q_len) % chunk
        b0 = first // block_size
        blocks = block_tables[b, b0 : -(-ctx // block_size)].long()
        lo, hi = first - b0 * block_size, ctx - b0 * block_size
        k = _pages(k_cache, k_scale, blocks, d).flatten(0, 1)[lo:hi].transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        v = k if same else _pages(v_cache, v_scale, blocks, d).flatten(0, 1)[lo:hi].transpose(0, 1).to(q.dtype)
        qs = q[s:e].view(q_len, num_kv_heads, group, d).permute(1, 0, 2, 3)  # [Hkv, q_len, group, D]
        if q_len == 1:  # decode: every kept key is visible
            o = pa.attend_torch(qs.reshape(num_kv_heads, group, d), k, v, None, scale, softcap,
                                _row_sinks(sinks, num_kv_heads, 1))
            out[s] = o.reshape(num_q_heads, d)
            continue
        per_call = max(1, CPU_SCORE_ELEMENTS // (num_q_heads * (hi - lo)))
        key_pos = torch.arange(first, ctx, device=q.device)
        for i in range(0, q_len, per_call):
            j = min(q_len, i + per_call)
            q_pos = torch.arange(ctx - q_len + i, ctx - q_len + j, device=q.device)
            end = ctx - q_len + j - first  # keys past the chunk's last query are never seen
            mask = key_pos[None, :end] <= q_pos[:, None]
            if window is not None:
                mask &= key_pos[None, :end] > q_pos[:, None] - window
            if chunk is not None:
                mask &= key_pos[None, :end] >= pa.chunk_start(q_pos[:, None], chunk)
            mask = mask[:, None, :].expand(j - i, group, end).reshape((j - i) * group, end)
            qc = qs[:, i:j].reshape(num_kv_heads, (j - i) * group, d)
            o = pa.attend_torch(qc, k[:, :end], v[:, :end], mask, scale, softcap,
                                _row_sinks(sinks, num_kv_heads, j - i))  # [Hkv, rows, D]
            out[s + i : s + j] = o.view(num_kv_heads, j - i, group, d).permute(1, 0, 2, 3).reshape(j - i, num_q_heads, d)
    return out


class PagedAttention(nn.Module):
    """Rotary embedding, the KV-cache store and attention: the first two fused on the GPU, with
    the per-head q/k norms of Qwen3 and Gemma 3 when forward is given them (``QKNorm``).

    With a quantized cache (kernels/kv_quant.py) the kernels also take k_scale and v_scale: for
    FP8 this layer's own one-element tensors (the checkpoint's, or measured by the runner at
    start-up or on the first prefill), for int4 the per-block (keys) and per-group (values)
    tensors bound with the cache. FP8 keys are stored turned by k_transform (R), and the queries
    are turned to match before attention (kv_quant explains why). What is measured is written in
    place, so captured CUDA graphs read the new values.

    ``scale`` multiplies the scores (default head_dim ** -0.5); ``window`` limits this layer to
    the last ``window`` positions, ``softcap`` caps its scores; forward's ``sinks`` (float32, one
    per query head) join each softmax's denominator (kernels/paged_attention.py).
    ``chunk``: chunked local attention (Llama 4: a query at p sees keys from p - p % chunk), masked
    by every path; a model passes it only where a context can pass one.

    The runner sizes and allocates each layer's cache from num_kv_heads and head_dim, a key and
    a value cache each, or a key cache alone where ``cache_values`` is False (LatentAttention)."""

    cache_values = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding, backend: str,
                 scale: float | None = None, window: int | None = None, softcap: float | None = None,
                 chunk: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.chunk = chunk
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        self.rotary = rotary
        self.force_torch = backend == "torch"
        self.k_cache: torch.Tensor | None = None  # bound by the model runner
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.k_transform: torch.Tensor | None = None
        self.fp8_k_scale = torch.ones(1, dtype=torch.float32)  # on the device the model is built on
        self.fp8_v_scale = torch.ones(1, dtype=torch.float32)
        self.kv_scales_from_checkpoint = False
        self.measure_kv_scales = False  # set by the runner: the next forward measures the FP8 scales

    def load_kv_scale(self, kind: str, scale: torch.Tensor) -> None:
        """A checkpoint's ``k_scale`` / ``v_scale`` (dequantized = stored * scale). A per-head
        scale becomes the largest one: this cache keeps one per layer."""
        target = self.fp8_k_scale if kind == "k_scale" else self.fp8_v_scale
        target.fill_(float(scale.float().max()))
        self.kv_scales_from_checkpoint = True

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
        """The cache from kv_quant.allocate(); an FP8 one reads this layer's scales."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.k_transform = None
        mode = kvq.kv_mode(k_cache)
        if mode == kvq.KV_FP8:
            k_scales, v_scales = self.fp8_k_scale, self.fp8_v_scale
            self.k_transform = kvq.key_rotation(self.head_dim, k_cache.device)
        self.k_scale, self.v_scale = k_scales, v_scales

    def _measure_kv_scales(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           qk_norm: QKNorm | None) -> None:
        """This step's keys (normed and rotated, as the store sees them) and values set, once
        (blocks already written keep their meaning): the FP8 scales, from the largest magnitudes
        of the turned keys and of the values (kv_quant.fp8_scale_from_amax)."""
        if qk_norm is not None:
            k = rms_norm_torch(k, qk_norm.k_weight, qk_norm.eps)
        k = rotary_torch(positions, k, k, self.rotary.cos_sin_cache)[1]
        dtype = self.k_cache.dtype
        turned = kvq.transform_keys(k, self.k_transform)
        self.fp8_k_scale.copy_(kvq.fp8_scale_from_amax(turned.abs().amax(), dtype))
        self.fp8_v_scale.copy_(kvq.fp8_scale_from_amax(v.abs().amax(), dtype))
        self.measure_kv_scales = False

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        qk_norm: QKNorm | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D], not yet normed (``qk_norm``) nor rotated -> attention
        output [T, Hq, D]."""
        if self.measure_kv_scales:
            self._measure_kv_scales(positions, k, v, qk_norm)
        scales = (self.k_scale, self.v_scale)
        store = (self.rotary.cos_sin_cache, self.k_cache, self.v_cache, meta.slot_mapping, *scales, self.k_transform,
                 qk_norm)
        args = (self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale)
        options = dict(window=self.window, softcap=self.softcap, sinks=sinks, chunk=self.chunk)
        if q.device.type == "cpu":  # no kernels: per-sequence attention over its own blocks
            q = rotary_store_kv_torch(positions, q, k, v, *store)
            return paged_attention_cpu(q, *args, *scales, **options)
        if self.force_torch:
            q = rotary_store_kv_torch(positions, q, k, v, *store)
            return pa.paged_attention_torch(q, *args, *scales, **options)
        q = rotary_store_kv(positions, q, k, v, *store)  # transformed by k_transform too
        return pa.paged_attention(q, *args, meta.max_seqlen_q, k_scale=scales[0], v_scale=scales[1],
                                  num_decodes=meta.num_decodes, **options)


class LatentAttention(PagedAttention):
    """Multi-head latent attention (DeepSeek-V2) in its absorbed form, over a cache that holds
    one row per token: the normalized latent c (kv_lora_rank) then the rotated k_pe
    (qk_rope_head_dim). For DeepSeek-V2-Lite in bf16 that is (512 + 64) x 2 = 1,152 bytes a token
    and layer, where its 16 heads' keys (192 wide) and values (128) would take 10,240 (12,288
    as one shape for both).

    The model projects each head's q_nope into the latent space (q_lat = q_nope W_UK), so
    q.k = q_lat.c + q_pe.k_pe: MQA with one KV "head" of width kv_lora_rank + rope dim. The
    values are the latents themselves, the first kv_lora_rank columns of the same rows: this
    layer has a key cache only (cache_values False) and passes it as the value cache too; the
    output's last rope-dim columns (p . k_pe) are dropped, and the model maps the rest through
    W_UV. The cache is in the model's dtype, or FP8 with one scale per layer for the whole row
    (this layer's fp8_k_scale: the checkpoint's k_scale, or measured as PagedAttention's are).

    On the GPU, rows are stored and attended through kernels/mla_attention.py's Triton kernels
    (decode steps capturable in CUDA graphs); elsewhere (and with the "torch" backend) through
    its torch reference."""

    cache_values = False

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, rotary: RotaryEmbedding, backend: str,
                 scale: float):
        super().__init__(num_heads, 1, kv_lora_rank + rope_dim, rotary, backend, scale)
        self.kv_lora_rank = kv_lora_rank

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                      k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
        mode = kvq.kv_mode(k_cache)
        if mode == kvq.KV_INT4 or v_cache is not None:
            raise ValueError("multi-head latent attention keeps its cache in the model's dtype or FP8, keys only")
        self.k_cache = k_cache
        self.k_scale = self.fp8_k_scale if mode == kvq.KV_FP8 else None

    def forward(self, positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q_lat [T, H, kv_lora_rank], q_pe [T, H, rope], latent [T, kv_lora_rank] (normalized),
        k_pe [T, rope] (both not yet rotated), any of them a view with a unit last stride -> the
        attention-weighted latents [T, H, kv_lora_rank]."""
        cos_sin = self.rotary.cos_sin_cache
        if self.measure_kv_scales:  # one FP8 scale for the row, latent and rope key alike
            row = mla.rope_latent_torch(positions, q_lat, q_pe, latent, k_pe, cos_sin)[1]
            self.fp8_k_scale.copy_(kvq.fp8_scale_from_amax(row.abs().amax(), self.k_cache.dtype))
            self.fp8_v_scale.copy_(self.fp8_k_scale)
            self.measure_kv_scales = False
        q = mla.rope_store_latent(positions, q_lat, q_pe, latent, k_pe, cos_sin, self.k_cache, meta.slot_mapping,
                                  self.k_scale, self.force_torch)
        return mla.mla_attention(q, self.k_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, self.scale,
                                 self.kv_lora_rank, meta.max_seqlen_q, meta.num_decodes, self.k_scale,
                                 self.force_torch)
