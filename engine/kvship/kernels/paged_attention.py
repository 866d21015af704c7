"""Attention over a paged KV cache.

Cache (one pair per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
or a quantized layout with k_scale, v_scale (kernels/kv_quant.py; the dtype says which). Token t
of a sequence lives in block block_table[t // block_size], row t % block_size.
Batch: new tokens flattened, q [T, Hq, D]; cu_seqlens_q [B+1] delimits them; seq_lens [B] counts
each context *including* the new tokens (already stored); block_tables [B, max_blocks]. New token
i of sequence b sits at position seq_lens[b] - q_len[b] + i and attends causally. Options per
layer: ``window`` (a query at p sees keys p - window < k <= p), ``softcap`` (scores become
tanh(s / softcap) * softcap before the softmax) and ``sinks`` (gpt-oss: a learned logit per query
head that joins the softmax's denominator and attends to nothing) and ``chunk`` (chunked local
attention, Llama 4: a query at p sees keys p - p % chunk <= k <= p). The torch reference also
takes one cache as both (latent attention).

The plain-torch reference (CPU path, the kernels' oracle) comes first, then the Triton kernels
(storing new keys/values is fused with rotary: kernels/rotary.py). Decode: one program holds
all query heads of a KV head, so each K/V tile is read once per KV head, split over the context
(flash-decoding; a second kernel merges the splits by log-sum-exp); graph-capturable, its grid
from shapes only. Prefill: one program per (query head, BLOCK_M new tokens, sequence), unmasked
tiles below the diagonal, masked ones on it. Both read pages through the block table (any block
size) and dequantize quantized pages in registers; the tile step is kernels/attention_tile.py.
WINDOW, CHUNK and SOFTCAP are compile-time constants (0: off)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvship.kernels import kv_quant as kvq
from kvship.kernels._triton import INTERPRET, device_sms, next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.attention_tile import (
    _attend_range,
    _pages,
    _split_channels,
    decode_row,
    first_visible,
    prefill_block,
    split_range,
    store_split_lse,
)
from kvship.kernels.tuning.attention import DECODE_CONFIG, DECODE_CONFIGS, PREFILL_CONFIG


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    k_transform: torch.Tensor | None = None,
) -> None:
    """Write new keys/values [T, Hkv, D] into their slots; slot -1 means padding (skipped).
    ``k_transform``: how the keys are stored (kv_quant.transform_keys: FP8 keys turned by R)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    kvq.store(k, k_cache, k_scale, slot_mapping, k_transform)
    kvq.store(v, v_cache, v_scale, slot_mapping)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scales: torch.Tensor | None = None, head_dim: int = 0) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, Hkv, D]
    (dequantized to float32 when the cache is quantized)."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return kvq.pages(cache, scales, block_table[:n_blocks].long(), head_dim).flatten(0, 1)[:length]


def chunk_start(pos: torch.Tensor, chunk: int) -> torch.Tensor:
    """The first key a query at ``pos`` sees under chunked local attention."""
    return pos - pos % chunk


def attend_torch(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v; with ``softcap`` the scores are capped first, and
    ``sinks`` (broadcast against the scores' [..., rows, 1]) join the softmax as one more column
    that is then dropped: what scaled_dot_product_attention cannot do is written out."""
    if softcap is None and sinks is None:
        if q.dim() == 3:  # as [1, H, rows, D]: with 3-D inputs a CPU took the math path, 1.5-3x slower than flash
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1) @ v
    s = torch.cat([s, sinks.to(s.dtype).expand(*s.shape[:-1], 1)], dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1] @ v


def _decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale: float, group: int,
                            k_scale, v_scale, window: int | None, softcap: float | None,
                            sinks: torch.Tensor | None, chunk: int | None = None) -> torch.Tensor:
    """One new token per sequence: gather every context into a padded [B, Hkv, L, D] batch and
    attend in one call, the query heads of a KV head standing in the query-length dimension."""
    batch, block_size, d = q.shape[0], k_cache.shape[1], q.shape[-1]
    longest = int(seq_lens.max())
    tables = block_tables[:, : -(-longest // block_size)].long()
    k = kvq.pages(k_cache, k_scale, tables, d).flatten(1, 2)[:, :longest].transpose(1, 2).float()  # [B, Hkv, L, D]
    v = k if v_cache is k_cache else kvq.pages(v_cache, v_scale, tables, d).flatten(1, 2)[:, :longest].transpose(1, 2).float()
    qg = q.view(batch, k.shape[1], group, q.shape[-1]).float()  # [B, Hkv, group, D]
    pos = torch.arange(longest, device=q.device)[None, :]
    mask = pos < seq_lens[:, None]
    if window is not None:  # the query sits at seq_len - 1
        mask &= pos >= seq_lens[:, None] - window
    if chunk is not None:
        mask &= pos >= chunk_start(seq_lens[:, None] - 1, chunk)
    sinks = None if sinks is None else sinks.float().view(k.shape[1], group, 1)
    out = attend_torch(qg, k, v, mask[:, None, None, :], scale, softcap, sinks)
    return out.reshape(q.shape).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``chunk``: chunked local attention (Llama 4), a query at p sees keys from p - p % chunk."""
    num_q_heads, num_kv_heads, d = q.shape[1], k_cache.shape[2], q.shape[2]
    group = num_q_heads // num_kv_heads
    if q.shape[0] == seq_lens.shape[0] and bool((seq_lens > 0).all()):
        return _decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, group, k_scale, v_scale,
                                       window, softcap, sinks, chunk)
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        qb = q[s:e].transpose(0, 1)  # [Hq, q_len, D]
        kb = gather_kv(k_cache, block_tables[b], ctx, k_scale, d).transpose(0, 1).to(q.dtype)
        vb = kb if v_cache is k_cache else gather_kv(v_cache, block_tables[b], ctx, v_scale, d).transpose(0, 1).to(q.dtype)
        if group > 1:
            kb = kb.repeat_interleave(group, dim=0)
            vb = kb if v_cache is k_cache else vb.repeat_interleave(group, dim=0)
        q_len = e - s
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos  # causal with a cached prefix
        if window is not None:
            mask &= k_pos > q_pos - window
        if chunk is not None:
            mask &= k_pos >= chunk_start(q_pos, chunk)
        head_sinks = None if sinks is None else sinks.float().view(num_q_heads, 1, 1)
        ob = attend_torch(qb.float(), kb.float(), vb.float(), mask, scale, softcap, head_sinks)
        out[s:e] = ob.transpose(0, 1).to(q.dtype)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_seqlen_q: int, out=None,
                    k_scale=None, v_scale=None, window: int | None = None, softcap: float | None = None,
                    num_decodes: int = 0, sinks: torch.Tensor | None = None, chunk: int | None = None):
    if use_triton(q):
        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, max_seqlen_q, out=out,
            k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, num_decodes=num_decodes, sinks=sinks,
            chunk=chunk,
        )
    o = paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, k_scale, v_scale,
                              window=window, softcap=softcap, sinks=sinks, chunk=chunk)
    if out is not None:
        out.copy_(o)
        return out
    return o


# ----------------------------------------------------------------------------- Triton kernels

LOG2E = 1.4426950408889634

_PACKED = {False: 0, True: 1, "values": 2, "split": 3}

# A mixed step's prefill part reads the step's tables, lengths and query offsets from the
# sequence after its decodes, 16-byte aligned or not as the decode count falls: specialized on
# that, a server compiled new variants mid-serving (about a second each, every request waiting).
# The table's width (stride_bt) varies per batch too.
STEP_POINTERS = ["bt_ptr", "seqlens_ptr", "cuq_ptr"]


def packed_read(cfg: dict, kv_mode: int, q_dtype: torch.dtype, head_dim: int) -> int:
    """The PACKED constexpr a decode config launches, the one place that says where packed reads
    apply: quantized pages beside a 16-bit query (the dots then run in float16), int4 ones whose
    heads fill their tile (head_block); "split" only for int4 pages, else the packed read (True).
    int4 heads that leave part of their tile empty read as stored: read packed, they gave wrong
    outputs at long contexts on a GPU.
    Config "packed": True, keys and values converted in the registers they were loaded into;
    "values", values alone; "split", int4 even and odd channels kept apart, each dot taken as two."""
    packed = _PACKED[cfg.get("packed", False)]
    if kv_mode == kvq.KV_PLAIN or q_dtype == torch.float32:
        return 0
    if kv_mode == kvq.KV_INT4 and head_dim != head_block(head_dim, kv_mode):
        return 0
    if packed == 3 and kv_mode != kvq.KV_INT4:
        packed = 1
    return packed


def query_rows(group: int) -> int:
    """The decode kernel's BLOCK_G: the query heads of a KV head padded to a power of two of 16
    rows or more (a tl.dot's least)."""
    return max(16, next_pow2(group))


def head_block(head_dim: int, kv_mode: int) -> int:
    """The kernels' BLOCK_D, channels a tile holds per head (the q @ k dot's K): the head size
    rounded up to a power of two, and for int4 pages at least one group (32 channels): below
    that the sm_90 compiler lays the q @ k operand from int4 bytes out wrongly (kWidth 8 spans
    32 channels). Channels past the head are masked on load and store."""
    block_d = next_pow2(head_dim)
    if kv_mode == kvq.KV_INT4:
        block_d = max(block_d, kvq.INT4_GROUP)
    return block_d


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=STEP_POINTERS)
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seqlens_ptr, cuq_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, sinks_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_gb, stride_gs, stride_gh,
    stride_ksb, stride_ksh, stride_bt, stride_ot, stride_oh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, KV_MODE: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, PACKED: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False, SINKS: tl.constexpr = False, CHUNK: tl.constexpr = 0,
):
    # The step's metadata comes from the host and no kernel writes it: read before the PDL wait,
    # overlapping the kernel before.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row, has_token, seq_len = decode_row(cuq_ptr, seqlens_ptr, b)
    if not has_token:
        return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < HEAD_DIM
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    qmask = gmask[:, None] & dmask[None, :]
    even = _split_channels(BLOCK_D)  # PACKED 3: the even channels, and the odd ones (even + 1)
    # This split's share of the actual context (with a window or chunk: of the keys the query
    # sees, from the tile holding the first of them), in whole BLOCK_N tiles.
    first = 0
    q_pos = offs_g  # read only with a window or chunk: then every head's query is the last token
    if WINDOW > 0 or CHUNK > 0:
        first = (first_visible(seq_len - 1, WINDOW, CHUNK) // BLOCK_N) * BLOCK_N
        q_pos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)
    start, end = split_range(seq_len, first, split, BLOCK_N, NUM_SPLITS)

    pdl_wait(PDL)  # q and the new token's K/V: the rotary + KV-store kernel writes them
    if PACKED == 3:  # the host passes it for int4 pages beside a 16-bit query, BLOCK_D >= 32
        tl.static_assert(KV_MODE == 2 and BLOCK_D >= 32 and q_ptr.dtype.element_ty != tl.float32)
        qp = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + even[None, :]
        q_even = tl.load(qp, mask=gmask[:, None] & (even < HEAD_DIM)[None, :], other=0.0)
        q_odd = tl.load(qp + 1, mask=gmask[:, None] & (even + 1 < HEAD_DIM)[None, :], other=0.0)
        q = (tl.minimum(tl.maximum(q_even, -65504.0), 65504.0).to(tl.float16),
             tl.minimum(tl.maximum(q_odd, -65504.0), 65504.0).to(tl.float16))
        acc = (tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32), tl.zeros([BLOCK_G, BLOCK_D // 2], tl.float32))
    else:
        q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if KV_MODE == 1:
        qk_scale = qk_scale * tl.load(ks_ptr)
    pages = _pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                   stride_vh, stride_gb, stride_gs, stride_gh, stride_ksb, stride_ksh, kvh)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, pages, start, end, end, qk_scale, offs_n, offs_d, dmask,
                                  BLOCK_SIZE, 1 + (WINDOW > 0 or CHUNK > 0), KV_MODE, WINDOW, SOFTCAP, PACKED,
                                  INTERPRET, HEAD_DIM, CHUNK)
    if SINKS and NUM_SPLITS == 1:  # split contexts: the reduce kernel adds the sink once
        l_i += sink_weight(sinks_ptr, heads, gmask, m_i)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if NUM_SPLITS == 1:
        o_ptr = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh
    else:
        o_ptr = mid_o_ptr + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos
    if PACKED == 3:
        _store_rows(o_ptr, acc[0] / l_safe[:, None], even, gmask, vs_ptr, HEAD_DIM, KV_MODE)
        _store_rows(o_ptr, acc[1] / l_safe[:, None], even + 1, gmask, vs_ptr, HEAD_DIM, KV_MODE)
    else:
        _store_rows(o_ptr, acc / l_safe[:, None], offs_d, gmask, vs_ptr, HEAD_DIM, KV_MODE)
    if NUM_SPLITS > 1:
        store_split_lse(mid_lse_ptr + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, m_i, l_i, gmask)


@triton.jit
def sink_weight(sinks_ptr, heads, mask, m_i):
    """exp(sink - max score) of each row's head, the sink's share of the softmax denominator
    beside keys summed relative to m_i (log2 domain); 0 for a row that saw no key."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(m_i > float("-inf"), tl.exp2(sink - m_i), 0.0)


@triton.jit
def _store_rows(o_ptr, o, channels, gmask, vs_ptr, HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr):
    """The decode output's ``channels`` of each head (o_ptr: each head's row [BLOCK_G, 1]), FP8
    values' scale applied."""
    if KV_MODE == 1:
        o = o * tl.load(vs_ptr)
    tl.store(o_ptr + channels[None, :], o.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & (channels < HEAD_DIM)[None, :])


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, cuq_ptr, out_ptr, sinks_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(cuq_ptr + b)  # the host's, as in _decode_kernel: before the wait
    if tl.load(cuq_ptr + b + 1) <= q_row:
        return
    pdl_wait(PDL)
    q_row = q_row.to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    dmask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b.to(tl.int64) * stride_mlb + h * stride_mlh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(
        mid_o_ptr + b.to(tl.int64) * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=smask[:, None] & dmask[None, :], other=0.0,
    )
    denom = tl.sum(w, 0)
    if SINKS:  # the head's sink as one more split that attends to nothing
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m, sink)
        w = w * tl.exp2(m - top)
        denom = denom * tl.exp2(m - top) + tl.exp2(sink - top)
    denom = tl.where(denom > 0.0, denom, 1.0)
    res = tl.sum(o * w[:, None], 0) / denom
    tl.store(out_ptr + q_row * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=STEP_POINTERS)
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seqlens_ptr, cuq_ptr, out_ptr, sinks_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_gb, stride_gs, stride_gh,
    stride_ksb, stride_ksh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, SINKS: tl.constexpr = False, CHUNK: tl.constexpr = 0,
):
    h, mblk, b, q_start, q_len, ctx, has_rows = prefill_block(cuq_ptr, seqlens_ptr, BLOCK_M)
    if not has_rows:
        return
    prefix = ctx - q_len
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < HEAD_DIM
    qmask = (offs_m[:, None] < q_len) & dmask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    pages = _pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                   stride_vh, stride_gb, stride_gs, stride_gh, stride_ksb, stride_ksh, kvh)
    # Keys before the block's first row position are visible to every row: no mask there.
    full_end = ((prefix + mblk * BLOCK_M) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(prefix + (mblk + 1) * BLOCK_M, ctx)
    if KV_MODE == 1:
        qk_scale = qk_scale * tl.load(ks_ptr)
    full_start = 0
    if WINDOW > 0 or CHUNK > 0:
        # Tiles below the first row's first visible key are skipped; the keys from the block's
        # last row's first one are visible to every row (unmasked, up to full_end); the tiles
        # between are masked. (first_visible never decreases along the rows.)
        lo = (first_visible(prefix + mblk * BLOCK_M, WINDOW, CHUNK) // BLOCK_N) * BLOCK_N
        last = prefix + tl.minimum((mblk + 1) * BLOCK_M, q_len) - 1
        full_start = tl.cdiv(first_visible(last, WINDOW, CHUNK), BLOCK_N) * BLOCK_N
        full_start = tl.maximum(tl.minimum(full_start, full_end), lo)
        full_end = tl.maximum(full_end, full_start)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, pages, lo, full_start, ctx, qk_scale, offs_n, offs_d,
                                      dmask, BLOCK_SIZE, 2, KV_MODE, WINDOW, SOFTCAP, 0, False, 0, CHUNK)
    # unmasked below the diagonal, then masked on it
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, pages, full_start, full_end, ctx, qk_scale, offs_n, offs_d,
                                  dmask, BLOCK_SIZE, 0, KV_MODE, WINDOW, SOFTCAP, 0, False, 0, CHUNK)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, q_pos, pages, full_end, hi, ctx, qk_scale, offs_n, offs_d,
                                  dmask, BLOCK_SIZE, 2, KV_MODE, WINDOW, SOFTCAP, 0, False, 0, CHUNK)
    if SINKS:
        l_i += sink_weight(sinks_ptr, h + 0 * offs_m, offs_m >= 0, m_i)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if KV_MODE == 1:
        o = o * tl.load(vs_ptr)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=qmask)


def decode_reduce(mid_o: torch.Tensor, mid_lse: torch.Tensor, cu_seqlens_q: torch.Tensor, out: torch.Tensor,
                  sinks: torch.Tensor | None = None) -> None:
    """A split decode's partial outputs (mid_o [B, H, splits, D] fp32, mid_lse [B, H, splits],
    log2 domain) merged by their log-sum-exp into out's row of each sequence (its cu_seqlens_q
    start): the second kernel of every split-context decode (this file's, kernels/mla_attention.py's)."""
    batch, num_heads, num_splits, head_dim = mid_o.shape
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, cu_seqlens_q, out, mid_lse if sinks is None else sinks,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        SINKS=sinks is not None, num_warps=4, **pdl_launch(out),
    )


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, sms: int, block_n: int,
                      config: dict | None = None) -> int:
    """How many context splits the decode kernel uses: enough programs for ``waves`` rounds
    over the SMs, a power of two, no more than there are BLOCK_N tiles in the longest
    possible context. Depends on shapes only (CUDA-graph safe)."""
    config = config or DECODE_CONFIG
    programs = max(1, batch * num_kv_heads)
    target = config["waves"] * sms
    if programs >= target:
        return 1
    splits = next_pow2(-(-target // programs))
    tiles = max(1, -(-max_context // block_n))
    while splits > 1 and splits > tiles:
        splits //= 2
    return max(1, min(splits, config["max_splits"]))


def prefill_block_m(cfg: dict, max_seqlen_q: int) -> int:
    """The prefill kernel's query tile (a constexpr): the configuration's, or the power of two
    (16 at least) that holds a shorter step's longest query."""
    return min(cfg["block_m"], max(16, next_pow2(max_seqlen_q)))


# One prompt of each length compiles every query tile prefill_block_m gives (runner start-up),
# so that a short chunk or a verify step does not compile one while requests wait.
PREFILL_TILE_LENGTHS = (16, 32, 64, 128)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    decode_config: dict | None = None,
    num_decodes: int = 0,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Triton twin of ``paged_attention_torch`` (same layouts and semantics).

    ``max_seqlen_q`` (a host int) picks the path: 1 means every sequence has one new token
    (decode); otherwise the varlen prefill kernel, except for the first ``num_decodes``
    sequences (one new token each), which go through the decode kernel, as it reads a KV head
    once for its whole group. ``num_splits`` and ``decode_config`` override the decode split
    count and settings (tests, benchmarks). q, k_cache, v_cache need a contiguous last dim.
    """
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if max_seqlen_q > 1 and 0 < num_decodes < seq_lens.shape[0]:
        # Both kernels find their query rows through cu_seqlens_q, so q and out stay whole.
        options = dict(out=out, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, window=window,
                       softcap=softcap, decode_config=decode_config, sinks=sinks, chunk=chunk)
        d = num_decodes
        paged_attention_triton(q, k_cache, v_cache, block_tables[:d], seq_lens[:d], cu_seqlens_q[:d + 1], scale, 1,
                               **options)
        return paged_attention_triton(q, k_cache, v_cache, block_tables[d:], seq_lens[d:], cu_seqlens_q[d:], scale,
                                      max_seqlen_q, **options)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_q_heads % num_kv_heads == 0
    group = num_q_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    qk_scale = float(scale) * LOG2E
    options = dict(WINDOW=window or 0, SOFTCAP=(softcap or 0.0) * LOG2E, SINKS=sinks is not None,
                   CHUNK=chunk or 0)  # per layer
    sinks_arg = q if sinks is None else sinks  # unread without sinks
    kv_mode = kvq.kv_mode(k_cache)
    block_d = head_block(head_dim, kv_mode)
    group_strides = kvq.scale_strides(kv_mode, k_scale, v_scale)
    scales = (k_cache, v_cache) if kv_mode == kvq.KV_PLAIN else (k_scale, v_scale)  # plain: unread
    common = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *group_strides,
        block_tables.stride(0), out.stride(0), out.stride(1),
    )
    if max_seqlen_q == 1:
        cfg = decode_config or DECODE_CONFIGS[kv_mode]
        block_n = cfg["block_n"]
        # a p @ v dot's K of 16 from unpacked int4 bytes is mis-laid as in head_block
        assert kv_mode != kvq.KV_INT4 or block_n >= 32, "int4 pages are read in tiles of 32 tokens or more"
        if num_splits is None:
            context = block_tables.shape[1] * block_size
            for span in (window, chunk):  # the tiles a windowed or chunked query reads, at most
                if span:
                    context = min(context, span + block_n)
            num_splits = decode_num_splits(batch, num_kv_heads, context, device_sms(q), block_n, cfg)
        packed = packed_read(cfg, kv_mode, q.dtype, head_dim)
        if num_splits > 1:
            mid_o = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
            mid_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        else:
            mid_o = mid_lse = out  # unused
        mid_strides = (
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2) if num_splits > 1 else 0,
            mid_lse.stride(0), mid_lse.stride(1),
        )
        _decode_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, *scales, block_tables, seq_lens, cu_seqlens_q, out, mid_o, mid_lse, sinks_arg,
            qk_scale, *common, *mid_strides,
            GROUP=group, BLOCK_G=query_rows(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, KV_MODE=kv_mode, **options,
            PACKED=packed, INTERPRET=INTERPRET,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q),
        )
        if num_splits > 1:
            decode_reduce(mid_o, mid_lse, cu_seqlens_q, out, sinks)
        return out

    cfg = PREFILL_CONFIG.get(head_dim, PREFILL_CONFIG[128])
    block_m = prefill_block_m(cfg, max_seqlen_q)
    grid = (num_q_heads, triton.cdiv(max_seqlen_q, block_m), batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, *scales, block_tables, seq_lens, cu_seqlens_q, out, sinks_arg,
        qk_scale, *common,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], KV_MODE=kv_mode, **options,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
