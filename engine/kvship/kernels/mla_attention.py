"""Multi-head latent attention (DeepSeek-V2) over its paged latent cache, in the absorbed form
(layers/attention.py LatentAttention explains the algebra).

Cache: [num_blocks, block_size, 1, rank + rope]: per token the normalized latent c, then the
rotated k_pe, in the model's dtype or FP8 (one scale per layer for the whole row, ``kv_scale``).
Query: [T, H, rank + rope]: each head's q_nope projected into the latent space,
then its rotated q_pe. A head's score over a token is q . row (both parts), its output the
probability-weighted sum of the latents: [T, H, rank], the rows' first ``rank`` channels.

The torch reference is paged_attention_torch with the cache as both keys and values (MQA: one
KV "head", every query head in its group), its output cut to ``rank`` channels.

The Triton kernels read each tile of rows once for all the query rows of a program, as the
latent and rope parts ([BLOCK_N, rank] and [BLOCK_N, rope]: the 576-wide rows of V2 and V2-Lite
would pad to 1,024 channels as one head), and take the scores as two dots and the output as a
third on the same latent tile (``_mla_range``). The decode kernel (one new token per sequence)
takes a block of heads as its rows and splits the context over programs as the paged decode
kernel does (flash-decoding), merged by paged_attention's reduce kernel; it is CUDA-graph
capturable (grid and splits come from shapes alone). The prefill kernel takes BLOCK_M new
tokens of one head as its rows, causal over the cached prefix: the absorbed form costs some
3.4x the FLOPs of expanding each head's keys and values for a long prompt (576 + 512 channels
per score and output against 192 + 128), which it saves in gathers and memory.
"""
from __future__ import annotations

import torch

from kvship.kernels import kv_quant as kvq
from kvship.kernels import paged_attention as pa
from kvship.kernels import rotary
from kvship.kernels._triton import device_sms, next_pow2, pdl_launch, pdl_wait, tl, triton, use_triton
from kvship.kernels.attention_tile import decode_row, dot_precision, prefill_block, split_range, store_split_lse
from kvship.kernels.numerics import fp8_round
from kvship.kernels.tuning.attention import MLA_DECODE_CONFIG, MLA_PREFILL_CONFIG


def rope_latent_torch(positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                      k_pe: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the query [T, H, rank + rope], the cache rows [T, rank + rope]): q_lat [T, H, rank] beside
    q_pe [T, H, rope] rotated, latent [T, rank] beside k_pe [T, rope] rotated (halves layout)."""
    q_pe, k_pe = rotary.rotary_torch(positions, q_pe, k_pe[:, None], cos_sin_cache)
    return torch.cat([q_lat, q_pe], dim=-1), torch.cat([latent, k_pe[:, 0]], dim=-1)


def rope_store_latent_torch(positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                            k_pe: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The query (rope_latent_torch); the rows into their slots of the cache (an FP8 one: divided
    by kv_scale); slot -1 (padding) writes nothing."""
    q, rows = rope_latent_torch(positions, q_lat, q_pe, latent, k_pe, cos_sin_cache)
    keep = slots >= 0
    kvq.store(rows[keep][:, None], cache, kv_scale, slots[keep])
    return q


def mla_attention_torch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, scale: float, rank: int,
                        kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, rank + rope] -> [T, H, rank] (module docstring); an FP8 cache's rows read times
    kv_scale, as keys and as values."""
    out = pa.paged_attention_torch(q, cache, cache, block_tables, seq_lens, cu_seqlens_q, scale, kv_scale, kv_scale)
    return out[..., :rank]


def _fp8_format(cache: torch.Tensor) -> int:
    """The kernels' FP8 constexpr: 0 a 16-bit (or float32) cache, 1 e4m3, 2 e5m2."""
    return {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(cache.dtype, 0)


def _attention_launch(q: torch.Tensor, cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """What both attention launchers check and pass: the query and cache layouts they read, and
    the FP8 constexpr with the scale pointer (the cache itself, unread, for a 16-bit one)."""
    assert q.stride(-1) == 1 and cache.is_contiguous() and cache.shape[2] == 1 and cache.shape[3] == q.shape[-1]
    fp8 = _fp8_format(cache)
    return fp8, kv_scale if fp8 else cache


@triton.jit
def _cache_value(x, scale_ptr, dst_ty: tl.constexpr, FP8: tl.constexpr):
    """Values as an FP8 cache stores them: kv_quant.fp8_quantize's arithmetic, an exact division
    rounded to nearest in fp32."""
    if FP8:
        x = fp8_round(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), FP8 == 2)
    return x.to(dst_ty)


@triton.jit
def _rope_store_latent_kernel(
    pos_ptr, cs_ptr, qlat_ptr, qpe_ptr, lat_ptr, kpe_ptr, q_ptr, cache_ptr, slots_ptr, scale_ptr,
    stride_cs, stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_lt, stride_kt, stride_qt, stride_qh, stride_c,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False,
):
    """One (token, block of BLOCK_H heads) per program: the heads' query rows (latent part copied,
    rope part rotated); the first head block also stores the token's cache row (slot -1: none).
    The token's position, its cos/sin and its slot (the step's metadata and a constant table) are
    read before the PDL wait, as kernels/rotary.py's kernel reads them."""
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < NUM_HEADS)[:, None]
    offs_r = tl.arange(0, BLOCK_R)
    rmask = (offs_r < RANK)[None, :]
    offs_h = tl.arange(0, BLOCK_HALF)
    half_mask = (offs_h < HALF)[None, :]
    cos, sin = rotary.cos_sin(pos_ptr, cs_ptr, t, stride_cs, offs_h, offs_h < HALF, HALF)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    pdl_wait(PDL)  # the projections' outputs: the kernels before write them
    q_rows = q_ptr + t64 * stride_qt + heads[:, None] * stride_qh
    lat = tl.load(qlat_ptr + t64 * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :], mask=hmask & rmask)
    tl.store(q_rows + offs_r[None, :], lat, mask=hmask & rmask)
    # rotated in fp32 and rounded to the query's dtype, as rotary_torch
    r1, r2 = rotary.rotated_halves(qpe_ptr + t64 * stride_qpt, stride_qph, heads, cos, sin, offs_h, hmask & half_mask,
                                   qpe_ptr, 0.0, HALF, False)
    ty = qpe_ptr.dtype.element_ty
    tl.store(q_rows + RANK + offs_h[None, :], r1.to(ty), mask=hmask & half_mask)
    tl.store(q_rows + RANK + HALF + offs_h[None, :], r2.to(ty), mask=hmask & half_mask)
    if tl.program_id(1) > 0 or slot < 0:
        return
    dst = cache_ptr + slot * stride_c
    cty = cache_ptr.dtype.element_ty
    c = tl.load(lat_ptr + t64 * stride_lt + offs_r[None, :], mask=rmask)
    tl.store(dst + offs_r[None, :], _cache_value(c, scale_ptr, cty, FP8), mask=rmask)
    # the key part: one row (a head of stride 0), rounded to k_pe's dtype before any FP8 quantization
    k1, k2 = rotary.rotated_halves(kpe_ptr + t64 * stride_kt, 0, tl.arange(0, 1), cos, sin, offs_h, half_mask,
                                   kpe_ptr, 0.0, HALF, False)
    kty = kpe_ptr.dtype.element_ty
    tl.store(dst + RANK + offs_h[None, :], _cache_value(k1.to(kty), scale_ptr, cty, FP8), mask=half_mask)
    tl.store(dst + RANK + HALF + offs_h[None, :], _cache_value(k2.to(kty), scale_ptr, cty, FP8), mask=half_mask)


def rope_store_latent_triton(positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                             k_pe: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                             kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of ``rope_store_latent_torch`` in one launch (the reference takes some twenty
    elementwise kernels a layer), on strided views as the projections leave them; no host sync
    for the padding rows' mask, so a captured decode step may store."""
    tokens, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    width = cache.shape[-1]
    assert width == rank + rope and rope % 2 == 0 and cache.is_contiguous() and cos_sin_cache.stride(-1) == 1
    assert q_lat.stride(-1) == q_pe.stride(-1) == latent.stride(-1) == k_pe.stride(-1) == 1
    q = torch.empty(tokens, num_heads, width, dtype=q_lat.dtype, device=q_lat.device)
    fp8 = _fp8_format(cache)
    block_h = min(16, next_pow2(num_heads))
    if tokens:
        _rope_store_latent_kernel[(tokens, triton.cdiv(num_heads, block_h))](
            positions, cos_sin_cache, q_lat, q_pe, latent, k_pe, q, cache, slots, kv_scale if fp8 else cache,
            cos_sin_cache.stride(0), q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
            latent.stride(0), k_pe.stride(0), q.stride(0), q.stride(1), width,
            NUM_HEADS=num_heads, RANK=rank, HALF=rope // 2, BLOCK_R=next_pow2(rank), BLOCK_HALF=next_pow2(rope // 2),
            BLOCK_H=block_h, FP8=fp8, **pdl_launch(q_lat),
        )
    return q


@triton.jit
def _mla_query(q_rows, offs_r, offs_p, qmask, RANK: tl.constexpr, ROPE: tl.constexpr):
    """Query rows (q_rows: each row's first element, [R, 1]) as their latent and rope parts."""
    q_lat = tl.load(q_rows + offs_r[None, :], mask=qmask[:, None] & (offs_r < RANK)[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + offs_p[None, :], mask=qmask[:, None] & (offs_p < ROPE)[None, :], other=0.0)
    return q_lat, q_pe


@triton.jit
def _mla_range(acc, l_i, m_i, q_lat, q_pe, q_pos, c_ptr, bt_row, lo, hi, qk_scale, stride_cb, stride_cs,
               RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """The rows' running softmax state (log2 domain) over the positions from lo up to hi, in
    tiles of BLOCK_N rows of the cache read once for all query rows: the latent part and the rope
    part, two dots for the scores and a third for the output on the same latent tile. CAUSAL: a
    query row at position q_pos sees positions up to its own."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, q_lat.shape[1])
    offs_p = tl.arange(0, q_pe.shape[1])
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < hi
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = c_ptr + page * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        c = tl.load(row[:, None] + offs_r[None, :], mask=nmask[:, None] & (offs_r < RANK)[None, :], other=0.0)
        pe = tl.load(row[:, None] + RANK + offs_p[None, :], mask=nmask[:, None] & (offs_p < ROPE)[None, :],
                     other=0.0)
        if FP8:
            c, pe = c.to(q_lat.dtype), pe.to(q_lat.dtype)
        # (dots with an accumulator argument come out wrong for bf16 operands in the interpreter)
        qk = tl.dot(q_lat, tl.trans(c), input_precision=dot_precision(c.dtype))
        qk = (qk + tl.dot(q_pe, tl.trans(pe), input_precision=dot_precision(c.dtype))) * qk_scale
        visible = nmask[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet: zeros, not NaN
        p = tl.exp2(qk - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=dot_precision(c.dtype))
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=pa.STEP_POINTERS)
def _mla_decode_kernel(
    q_ptr, c_ptr, scale_ptr, bt_ptr, seqlens_ptr, cuq_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, qk_scale,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP8: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """One (sequence, block of BLOCK_H heads, split of the context) per program: the heads are
    the tile's rows. FP8 pages are converted to the query's dtype as loaded; their scale
    multiplies the scores and the output. The sequence's bounds (the step's metadata) are read
    before the PDL wait, as paged_attention's decode kernel reads them."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    q_row, has_token, seq_len = decode_row(cuq_ptr, seqlens_ptr, b)
    if not has_token:
        return
    offs_r = tl.arange(0, BLOCK_R)
    hmask = heads < NUM_HEADS
    start, end = split_range(seq_len, 0, split, BLOCK_N, NUM_SPLITS)
    pdl_wait(PDL)  # the query and the new token's cache row: the rotary + latent store writes them
    q_lat, q_pe = _mla_query(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh, offs_r, tl.arange(0, BLOCK_P),
                             hmask, RANK, ROPE)
    kv_scale = 1.0
    if FP8:
        kv_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale
    acc, l_i, m_i = _mla_range(tl.zeros([BLOCK_H, BLOCK_R], tl.float32), tl.zeros([BLOCK_H], tl.float32),
                               tl.full([BLOCK_H], float("-inf"), tl.float32), q_lat, q_pe, heads,
                               c_ptr, bt_ptr + b.to(tl.int64) * stride_bt, start, end, qk_scale, stride_cb, stride_cs,
                               RANK, ROPE, BLOCK_SIZE, BLOCK_N, False, FP8)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * kv_scale
    if NUM_SPLITS == 1:
        o_ptr = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh
    else:
        o_ptr = mid_o_ptr + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos
    tl.store(o_ptr + offs_r[None, :], o.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & (offs_r < RANK)[None, :])
    if NUM_SPLITS > 1:
        store_split_lse(mid_lse_ptr + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, m_i, l_i, hmask)


@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=pa.STEP_POINTERS)
def _mla_prefill_kernel(
    q_ptr, c_ptr, scale_ptr, bt_ptr, seqlens_ptr, cuq_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr = 0,
):
    """One (head, BLOCK_M new tokens, sequence) per program: the tokens are the tile's rows,
    causal over the cached prefix and the new tokens (already stored)."""
    h, mblk, b, q_start, q_len, ctx, has_rows = prefill_block(cuq_ptr, seqlens_ptr, BLOCK_M)
    if not has_rows:
        return
    prefix = ctx - q_len
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mmask = offs_m < q_len
    rows = (q_start + offs_m).to(tl.int64)
    q_lat, q_pe = _mla_query(q_ptr + rows[:, None] * stride_qt + h * stride_qh, offs_r, tl.arange(0, BLOCK_P), mmask,
                             RANK, ROPE)
    kv_scale = 1.0
    if FP8:
        kv_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale
    hi = prefix + tl.minimum((mblk + 1) * BLOCK_M, q_len)  # the block's last row's position, plus one
    acc, l_i, m_i = _mla_range(tl.zeros([BLOCK_M, BLOCK_R], tl.float32), tl.zeros([BLOCK_M], tl.float32),
                               tl.full([BLOCK_M], float("-inf"), tl.float32), q_lat, q_pe, prefix + offs_m,
                               c_ptr, bt_ptr + b.to(tl.int64) * stride_bt, 0, hi, qk_scale, stride_cb, stride_cs,
                               RANK, ROPE, BLOCK_SIZE, BLOCK_N, True, FP8)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * kv_scale
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_r[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & (offs_r < RANK)[None, :])


def mla_decode_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, scale: float, rank: int, out: torch.Tensor,
                      kv_scale: torch.Tensor | None = None, num_splits: int | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """The decode kernel into out [T, H, rank] for sequences of one new token each."""
    cfg = config or MLA_DECODE_CONFIG
    batch, (_, num_heads, width) = seq_lens.shape[0], q.shape
    block_size, rope = cache.shape[1], width - rank
    fp8, scale_arg = _attention_launch(q, cache, kv_scale)
    if batch == 0:
        return out
    block_h = min(cfg["block_h"], max(16, next_pow2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = pa.decode_num_splits(batch, head_blocks, block_tables.shape[1] * block_size, device_sms(q),
                                          cfg["block_n"], cfg)
    if num_splits > 1:
        mid_o = torch.empty((batch, num_heads, num_splits, rank), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1))
    else:
        mid_o = mid_lse = out  # unused
        mid_strides = (0, 0, 0, 0, 0)
    _mla_decode_kernel[(batch, head_blocks, num_splits)](
        q, cache, scale_arg, block_tables, seq_lens, cu_seqlens_q, out, mid_o, mid_lse,
        float(scale) * pa.LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), *mid_strides,
        NUM_HEADS=num_heads, RANK=rank, ROPE=rope, BLOCK_R=next_pow2(rank), BLOCK_P=max(16, next_pow2(rope)),
        BLOCK_H=block_h, BLOCK_SIZE=block_size, BLOCK_N=cfg["block_n"], NUM_SPLITS=num_splits, FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(q),
    )
    if num_splits > 1:
        pa.decode_reduce(mid_o, mid_lse, cu_seqlens_q, out)
    return out


def mla_prefill_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, scale: float, rank: int, max_seqlen_q: int, out: torch.Tensor,
                       kv_scale: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """The prefill kernel into out [T, H, rank] for the sequences' new tokens (any count each)."""
    cfg = config or MLA_PREFILL_CONFIG
    batch, (_, num_heads, width) = seq_lens.shape[0], q.shape
    fp8, scale_arg = _attention_launch(q, cache, kv_scale)
    if batch == 0:
        return out
    block_m = min(cfg["block_m"], max(16, next_pow2(max_seqlen_q)))
    _mla_prefill_kernel[(num_heads, triton.cdiv(max_seqlen_q, block_m), batch)](
        q, cache, scale_arg, block_tables, seq_lens, cu_seqlens_q, out, float(scale) * pa.LOG2E,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1),
        RANK=rank, ROPE=width - rank, BLOCK_R=next_pow2(rank), BLOCK_P=max(16, next_pow2(width - rank)),
        BLOCK_SIZE=cache.shape[1], BLOCK_M=block_m, BLOCK_N=cfg["block_n"], FP8=fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def mla_attention_triton(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, scale: float, rank: int, max_seqlen_q: int,
                         num_decodes: int = 0, kv_scale: torch.Tensor | None = None,
                         num_splits: int | None = None) -> torch.Tensor:
    """[T, H, rank]: decodes (a decode step, or a mixed step's first ``num_decodes`` sequences)
    through the decode kernel, prompt chunks through the prefill kernel."""
    decodes = seq_lens.shape[0] if max_seqlen_q == 1 else num_decodes
    out = torch.empty(*q.shape[:2], rank, dtype=q.dtype, device=q.device)
    if decodes < seq_lens.shape[0]:  # both kernels find their rows through cu_seqlens_q
        d = decodes
        mla_prefill_triton(q, cache, block_tables[d:], seq_lens[d:], cu_seqlens_q[d:], scale, rank, max_seqlen_q,
                           out, kv_scale)
    return mla_decode_triton(q, cache, block_tables[:decodes], seq_lens[:decodes], cu_seqlens_q[:decodes + 1],
                             scale, rank, out, kv_scale, num_splits)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, scale: float, rank: int, max_seqlen_q: int, num_decodes: int = 0,
                  kv_scale: torch.Tensor | None = None, force_torch: bool = False) -> torch.Tensor:
    """The Triton path on the GPU (unless ``force_torch``), the torch reference elsewhere."""
    if force_torch or not use_triton(q):
        return mla_attention_torch(q, cache, block_tables, seq_lens, cu_seqlens_q, scale, rank, kv_scale)
    return mla_attention_triton(q, cache, block_tables, seq_lens, cu_seqlens_q, scale, rank, max_seqlen_q,
                                num_decodes, kv_scale)


def rope_store_latent(positions: torch.Tensor, q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                      k_pe: torch.Tensor, cos_sin_cache: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                      kv_scale: torch.Tensor | None = None, force_torch: bool = False) -> torch.Tensor:
    """The query for the attention kernels, the rows into the cache: Triton on the GPU (unless
    ``force_torch``), the torch reference elsewhere."""
    if force_torch or not use_triton(q_lat):
        return rope_store_latent_torch(positions, q_lat, q_pe, latent, k_pe, cos_sin_cache, cache, slots, kv_scale)
    return rope_store_latent_triton(positions, q_lat, q_pe, latent, k_pe, cos_sin_cache, cache, slots, kv_scale)
