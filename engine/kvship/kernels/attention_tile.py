"""One tile of attention over a paged KV cache, the part the decode and prefill kernels
(kernels/paged_attention.py) share, and the program bookkeeping kernels/mla_attention.py shares
too: a tile of keys and values gathered through the block table in any page layout
(``_load_kv``), folded into the online softmax in the log2 domain (``_attend_tile``)."""
from __future__ import annotations

from kvship.kernels import kv_quant as kvq
from kvship.kernels._triton import tl, triton
from kvship.kernels.activation import tanh


@triton.constexpr_function
def dot_precision(dtype):
    """float32 dots in full precision: Triton's default takes float32 operands as TF32, and a
    --dtype float32 model asks for float32."""
    return "ieee" if dtype == tl.float32 else None


@triton.jit
def _load_kv(c_ptr, g_ptr, tok_off, grp_off, offs_d, tmask, dmask,
             MASKED: tl.constexpr, D_FIRST: tl.constexpr, KV_MODE: tl.constexpr, DOT: tl.constexpr,
             PACKED: tl.constexpr = False, INTERPRET: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0):
    """A tile of cached keys ([BLOCK_D, BLOCK_N] when D_FIRST, for q @ k) or values ([BLOCK_N,
    BLOCK_D]). tok_off: each token's element (int4: byte) offset; grp_off: int4 values' group
    offsets, or int4 keys' block offsets. Plain and FP8 tiles come back as stored (the caller
    applies FP8's scale), int4 ones dequantized to DOT. PACKED (DOT float16): read token-major and
    converted in the load's registers by PTX (kv_quant), HEAD_DIM a compile-time value so that int4
    loads vectorize."""
    # one return at the end: the GPU compiler goes on past a return inside a constexpr branch
    if PACKED:  # the host launches it only where it applies (packed_read)
        tl.static_assert(HEAD_DIM > 0 and KV_MODE > 0 and DOT == tl.float16 and (KV_MODE == 1 or offs_d.shape[0] >= 32))
        if KV_MODE == 2 and D_FIRST:
            j = tl.arange(0, offs_d.shape[0] // 2)
            s_lo, z_lo = kvq.int4_block_scales(g_ptr, grp_off, 2 * j, 2 * j < HEAD_DIM, tl.float16)
            s_hi, z_hi = kvq.int4_block_scales(g_ptr, grp_off, 2 * j + 1, 2 * j + 1 < HEAD_DIM, tl.float16)
            lo, hi = kvq.int4_load_key_rows_split(c_ptr, tok_off, tmask, HEAD_DIM, s_lo, z_lo, s_hi, z_hi,
                                                  tok_off.shape[0], offs_d.shape[0], not INTERPRET)
            tile = tl.reshape(tl.join(lo, hi), (tok_off.shape[0], offs_d.shape[0]))  # element 2j, then 2j + 1
        elif KV_MODE == 2:
            tile = kvq.int4_load_rows_packed(c_ptr, g_ptr, tok_off, grp_off, tmask, HEAD_DIM, tok_off.shape[0],
                                             offs_d.shape[0], not INTERPRET)
        else:
            m = dmask[None, :]
            if MASKED:
                m = m & tmask[:, None]
            tile = kvq.fp8_to_f16(tl.load(c_ptr + tok_off[:, None] + offs_d[None, :], mask=m, other=0.0),
                                  not INTERPRET)
        if D_FIRST:
            tile = tl.trans(tile)
    elif KV_MODE == 2 and D_FIRST:
        codes = kvq.int4_load_codes(c_ptr, tok_off, tmask, tl.sum(dmask.to(tl.int32), 0), tok_off.shape[0],
                                    offs_d.shape[0], DOT)
        s, z = kvq.int4_block_scales(g_ptr, grp_off, offs_d, dmask, DOT)
        tile = tl.trans(kvq.int4_per_block(codes, s, z))
    elif KV_MODE == 2:
        tile = kvq.int4_load_rows(c_ptr, g_ptr, tok_off, grp_off, tmask, tl.sum(dmask.to(tl.int32), 0),
                                  tok_off.shape[0], offs_d.shape[0], DOT)
    else:
        if D_FIRST:
            t = tok_off[None, :]
            d = offs_d[:, None]
            m = dmask[:, None]
            if MASKED:
                m = m & tmask[None, :]
        else:
            t = tok_off[:, None]
            d = offs_d[None, :]
            m = dmask[None, :]
            if MASKED:
                m = m & tmask[:, None]
        tile = tl.load(c_ptr + t + d, mask=m, other=0.0)
    return tile


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos, pages, n0, kv_end, qk_scale, offs_n, offs_d, dmask,
    BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, KV_MODE: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, PACKED: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0, CHUNK: tl.constexpr = 0,
):
    """One BLOCK_N tile of keys/values, gathered through the block table, folded into the running
    softmax state (log2 domain). ``pages``: ``_pages``'s tuple. MASK: 0 none, 1 pos < kv_end, 2 that
    and causal (and the window or chunk: ``first_visible``). SOFTCAP in the log2 domain. PACKED: 1 keys and values packed, 2
    values alone, 3 int4 split into even and odd channels (q and acc are then pairs, q float16)."""
    (kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
     stride_gb, stride_gs, stride_gh, stride_ksb, stride_ksh, kvh) = pages
    pos = n0 + offs_n
    nmask = pos < kv_end
    # Where pages divide a tile (n0 is a multiple of BLOCK_N), the in-page offsets are the same in
    # every tile: computed from offs_n they leave the loop, which adds only 64-bit page bases.
    if offs_n.shape[0] % BLOCK_SIZE == 0:
        idx = n0 // BLOCK_SIZE + offs_n // BLOCK_SIZE
        row = offs_n % BLOCK_SIZE
    else:
        idx = pos // BLOCK_SIZE
        row = pos % BLOCK_SIZE
    if MASK > 0:
        page = tl.load(bt_row + idx, mask=nmask, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + idx).to(tl.int64)
    k_off = page * stride_kb + (row * stride_ks + kvh * stride_kh)
    v_off = page * stride_vb + (row * stride_vs + kvh * stride_vh)
    g_off = page * stride_gb + (row * stride_gs + kvh * stride_gh)  # int4 values only (strides 0 otherwise)
    kg_off = g_off  # int4 keys: the tile's blocks' offsets in the key scales, per block and channel
    if KV_MODE == 2:
        NB: tl.constexpr = (offs_n.shape[0] + BLOCK_SIZE - 1) // BLOCK_SIZE  # n0 is a multiple of BLOCK_N
        blocks = n0 // BLOCK_SIZE + tl.arange(0, NB)
        kb = tl.load(bt_row + blocks, mask=blocks * BLOCK_SIZE < kv_end, other=0).to(tl.int64)
        kg_off = kb * stride_ksb + kvh * stride_ksh
    # Quantized pages beside a bf16 query take fp16 dots: FP8 and int4 convert to fp16 cheaply
    # (to bf16 only through fp32), and fp16 loses nothing the quantization had not.
    if PACKED == 3:
        even = _split_channels(offs_d.shape[0])
        s_lo, z_lo = kvq.int4_block_scales(ks_ptr, kg_off, even, even < HEAD_DIM, tl.float16)
        s_hi, z_hi = kvq.int4_block_scales(ks_ptr, kg_off, even + 1, even + 1 < HEAD_DIM, tl.float16)
        k_even, k_odd = kvq.int4_load_key_rows_split(kc_ptr, k_off, nmask, HEAD_DIM, s_lo, z_lo, s_hi, z_hi,
                                                     offs_n.shape[0], offs_d.shape[0], not INTERPRET, True)
        qk = tl.dot(q[1], tl.trans(k_odd), tl.dot(q[0], tl.trans(k_even))) * qk_scale
    else:
        dot_dtype = q.dtype
        if KV_MODE > 0:
            if q.dtype == tl.bfloat16:
                dot_dtype = tl.float16
        kt = _load_kv(kc_ptr, ks_ptr, k_off, kg_off, offs_d, nmask, dmask, MASK > 0, True, KV_MODE, dot_dtype,
                      PACKED == 1, INTERPRET, HEAD_DIM)
        if dot_dtype == q.dtype:
            qk = tl.dot(q, kt.to(dot_dtype), input_precision=dot_precision(dot_dtype))
        else:
            qk = tl.dot(tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(dot_dtype), kt.to(dot_dtype))
        qk = qk * qk_scale
    if SOFTCAP > 0:  # cap * tanh(s / cap), s and cap both scaled by log2(e)
        qk = SOFTCAP * tanh(qk / SOFTCAP)
    if MASK == 1:
        qk = tl.where(nmask[None, :], qk, float("-inf"))
    elif MASK == 2:
        visible = (pos[None, :] <= q_pos[:, None]) & nmask[None, :]
        if WINDOW > 0 or CHUNK > 0:
            visible = visible & (pos[None, :] >= first_visible(q_pos, WINDOW, CHUNK)[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if WINDOW > 0 or CHUNK > 0:  # a row may see no key of a tile below its first visible one: zeros, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    if PACKED == 3:
        v_even, v_odd = kvq.int4_load_rows_split(vc_ptr, vs_ptr, v_off, g_off, nmask, HEAD_DIM, offs_n.shape[0],
                                                 offs_d.shape[0], not INTERPRET, True, True)
        p16 = p.to(tl.float16)
        acc = (tl.dot(p16, v_even, acc[0] * alpha[:, None]), tl.dot(p16, v_odd, acc[1] * alpha[:, None]))
    else:
        v = _load_kv(vc_ptr, vs_ptr, v_off, g_off, offs_d, nmask, dmask, MASK > 0, False, KV_MODE, dot_dtype,
                     PACKED > 0, INTERPRET, HEAD_DIM)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v.to(dot_dtype),
                                            input_precision=dot_precision(dot_dtype))
    return acc, l_i, m_new


@triton.jit
def first_visible(q_pos, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """The oldest key a query at ``q_pos`` sees: the first of its window (q_pos - WINDOW < k) and
    of its chunk (chunked local attention, Llama 4: k >= q_pos - q_pos % CHUNK), 0 without either."""
    first = q_pos * 0
    if WINDOW > 0:
        first = tl.maximum(q_pos - WINDOW + 1, 0)
    if CHUNK > 0:
        first = tl.maximum(first, q_pos - q_pos % CHUNK)
    return first


@triton.jit
def _pages(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
           stride_gb, stride_gs, stride_gh, stride_ksb, stride_ksh, kvh):
    """What ``_attend_tile`` reads one sequence's KV head through, as one value: the caches and
    their scales, the sequence's block-table row, the caches' strides (and the int4 scales': the
    values' per token and group, the keys' per block and channel), the KV head."""
    return (kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_gb, stride_gs, stride_gh, stride_ksb, stride_ksh, kvh)


@triton.jit
def _attend_range(
    acc, l_i, m_i, q, q_pos, pages, lo, hi, kv_end, qk_scale, offs_n, offs_d, dmask,
    BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, KV_MODE: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, PACKED: tl.constexpr = 0,
    INTERPRET: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0, CHUNK: tl.constexpr = 0,
):
    """``_attend_tile`` over the tiles from lo up to hi (BLOCK_N apart), all with one MASK."""
    for n0 in range(lo, hi, offs_n.shape[0]):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, pages, n0, kv_end, qk_scale, offs_n, offs_d, dmask,
                                     BLOCK_SIZE, MASK, KV_MODE, WINDOW, SOFTCAP, PACKED, INTERPRET, HEAD_DIM, CHUNK)
    return acc, l_i, m_i


@triton.jit
def decode_row(cuq_ptr, seqlens_ptr, b):
    """Sequence b of a decode batch: its query's row (int64), whether it has a new token (the
    first sequences of a mixed step have, and so do a graph's padding rows), its context length."""
    q_row = tl.load(cuq_ptr + b)
    return q_row.to(tl.int64), tl.load(cuq_ptr + b + 1) > q_row, tl.load(seqlens_ptr + b)


@triton.jit
def prefill_block(cuq_ptr, seqlens_ptr, BLOCK_M: tl.constexpr):
    """A prefill program's head, block of BLOCK_M new tokens and sequence (grid: heads, row
    blocks, sequences; the longest, last, row blocks start first); the sequence's first query
    row, new-token count and context length; whether the block holds any of its rows."""
    h = tl.program_id(0)
    mblk = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(cuq_ptr + b)
    q_len = tl.load(cuq_ptr + b + 1) - q_start
    return h, mblk, b, q_start, q_len, tl.load(seqlens_ptr + b), mblk * BLOCK_M < q_len


@triton.jit
def split_range(seq_len, first, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A split decode program's share [start, end) of the context from position ``first`` to
    ``seq_len``: NUM_SPLITS equal shares of its actual length, in whole BLOCK_N tiles."""
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)


@triton.jit
def store_split_lse(ptr, m_i, l_i, mask):
    """A split's log-sum-exp per row (log2 domain; -inf where it saw no key), for decode_reduce."""
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(ptr, lse, mask=mask)


@triton.jit
def _split_channels(BLOCK_D: tl.constexpr):
    """The even channel that each column of the split read's tiles (PACKED 3) holds, in the order
    int4_load_rows_split leaves them (WORD_ORDER: kv_quant.int4_word_order); the odd one is the
    next. The query is loaded and the output stored in this order, so the dots need no repacking."""
    return 2 * kvq.int4_word_order(tl.arange(0, BLOCK_D // 2))


