"""Quantized KV-cache storage (--kv-cache-dtype): each layout's math in plain torch (CPU path,
the tests' oracle) and as Triton helpers that kernels/rotary.py and the attention kernels inline.

auto          [blocks, block_size, Hkv, D] in the model's dtype, no scales
fp8*          the same shape in FP8; one float32 scale per layer for k and for v (stored = x / s)
int4          [blocks, block_size, Hkv, ceil(D/2)] uint8, element 2i in a byte's low nibble;
              keys: (scale, minimum) per block and channel [blocks, Hkv, D, 2] float16;
              values: per token and group of 32 channels [blocks, block_size, Hkv, D/32, 2]

FP8 keys are stored turned by a fixed orthogonal matrix R (``key_rotation``), queries by the
same R: a few key channels carry most of the magnitude, and turned, all share FP8's error.
int4 keys are quantized per channel over a block (KIVI): a channel's offset drifts slowly with
position, so one channel's tokens share a range far better than one token's channels do. Both
sides round the same way (floor(x + 0.5), round half to even), so they store the same bytes.
Quality figures: docs/kv-cache.md."""
from __future__ import annotations

import functools

import torch

from kvship.kernels._triton import tl, triton
from kvship.kernels.numerics import small_int_to_float

KV_PLAIN, KV_FP8, KV_INT4 = 0, 1, 2  # the kernels' KV_MODE

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INT4_LEVELS = 15  # codes 0..15
INT4_GROUP = 32  # channels per scale and minimum (the kernels assume 32)
SCALE_DTYPE = torch.float16  # int4 scale and minimum
MIN_FP8_SCALE = 1e-12  # clamp for a measured FP8 scale (an all-zero first prefill)
# A measured FP8 scale maps the largest magnitude seen to the format's largest / FP8_HEADROOM:
# later, larger values still fit, and small ones stay clear of the subnormals.
FP8_HEADROOM = 16.0


def kv_mode(cache: torch.Tensor) -> int:
    """Which layout a cache tensor holds, from its dtype alone."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return KV_FP8
    if cache.dtype == torch.uint8:
        return KV_INT4
    return KV_PLAIN


def bytes_per_block_head(kv_cache_dtype: str, head_dim: int, model_dtype: torch.dtype, block_size: int,
                         values: bool = True) -> int:
    """Bytes one block of one KV head takes in a layer's cache, its keys and (``values``) its
    values, scales included."""
    if kv_cache_dtype in FP8_DTYPES:
        per_token = head_dim
    elif kv_cache_dtype == "int4":
        codes = block_size * -(-head_dim // 2)
        keys = codes + 2 * SCALE_DTYPE.itemsize * head_dim
        return keys + values * (codes + block_size * 2 * SCALE_DTYPE.itemsize * -(-head_dim // INT4_GROUP))
    else:
        per_token = head_dim * torch.empty((), dtype=model_dtype).element_size()
    return (1 + values) * block_size * per_token


def allocate(kv_cache_dtype: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             model_dtype: torch.dtype, device, values: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(k_cache, v_cache, k_scales, v_scales) of one layer; the scales are int4's, else None (the
    per-layer FP8 scales belong to the attention layer). ``values=False``: a key cache alone
    (latent attention reads its values from the keys' rows)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if not values:
        assert kv_cache_dtype != "int4", kv_cache_dtype
        dtype = FP8_DTYPES.get(kv_cache_dtype, model_dtype)
        return torch.zeros(shape, dtype=dtype, device=device), None, None, None
    if kv_cache_dtype == "int4":
        packed = (num_blocks, block_size, num_kv_heads, -(-head_dim // 2))
        groups = (num_blocks, block_size, num_kv_heads, -(-head_dim // INT4_GROUP), 2)
        return (torch.zeros(packed, dtype=torch.uint8, device=device),
                torch.zeros(packed, dtype=torch.uint8, device=device),
                torch.zeros((num_blocks, num_kv_heads, head_dim, 2), dtype=SCALE_DTYPE, device=device),
                torch.zeros(groups, dtype=SCALE_DTYPE, device=device))
    dtype = FP8_DTYPES.get(kv_cache_dtype, model_dtype)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), None, None


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@functools.lru_cache(maxsize=None)  # asked at every launch of the rotary kernel
def hadamard_entry(head_dim: int) -> float:
    """The float32 magnitude of key_rotation(head_dim)'s entries when it is a Hadamard matrix
    (a power-of-two head: kernels make it from indices), else 0.0."""
    if head_dim & (head_dim - 1):
        return 0.0
    return float(torch.tensor(head_dim, dtype=torch.float64).rsqrt().float())


@functools.lru_cache(maxsize=None)
def key_rotation(head_dim: int, device: torch.device) -> torch.Tensor:
    """The FP8 keys' orthogonal matrix R [D, D] (float32): Hadamard / sqrt(D) for a power of two,
    else the Q of a seeded Gaussian matrix (the same on every rank and run)."""
    if hadamard_entry(head_dim):
        r = torch.ones(1, 1, dtype=torch.float64)
        while r.shape[0] < head_dim:
            r = torch.cat([torch.cat([r, r], 1), torch.cat([r, -r], 1)], 0)
        r /= head_dim**0.5
    else:
        g = torch.Generator().manual_seed(0)
        r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))[0]
    return r.to(device=device, dtype=torch.float32).contiguous()


def transform_keys(k: torch.Tensor, transform: torch.Tensor | None) -> torch.Tensor:
    """Keys [T, Hkv, D] as an FP8 cache stores them: k @ R in float32 (unchanged without R)."""
    return k if transform is None else k.float() @ transform


def transform_queries(q: torch.Tensor, transform: torch.Tensor | None) -> torch.Tensor:
    """q turned as the stored keys are, (q R).(k R) = q.k, in q's dtype."""
    return q if transform is None else (q.float() @ transform).to(q.dtype)


# ----------------------------------------------------------------------------- torch reference

def fp8_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def _int4_code_values(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of x (float32, not yet integers) for scales s and minimums z (float32)."""
    return torch.where(s > 0, torch.floor((x - z) / s + 0.5), 0.0).clamp(0, INT4_LEVELS)


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., D] (0..15) -> two a byte [..., ceil(D/2)] uint8, element 2i in the low nibble."""
    codes = codes.to(torch.uint8)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def int4_unpack(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """int4_pack's inverse: codes [..., head_dim] (uint8)."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)[..., :head_dim]


def int4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values x [..., D] -> (codes packed two a byte [..., ceil(D/2)] uint8,
    [..., ceil(D/32), 2] float16 scale and minimum of each group)."""
    xf = x.float()
    d = xf.shape[-1]
    n = -(-d // INT4_GROUP)

    def grouped(fill: float) -> torch.Tensor:  # [..., n, 32], a short last group filled up
        return torch.nn.functional.pad(xf, (0, n * INT4_GROUP - d), value=fill).unflatten(-1, (n, INT4_GROUP))

    lo, hi = grouped(float("inf")).amin(-1, keepdim=True), grouped(float("-inf")).amax(-1, keepdim=True)
    groups = torch.cat([((hi - lo) / INT4_LEVELS).to(SCALE_DTYPE), lo.to(SCALE_DTYPE)], -1)
    return int4_pack(_int4_code_values(xf, *int4_group_values(groups, d))), groups


def int4_group_values(groups: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's scale and minimum [..., D] (float32) from the groups [..., n, 2]."""
    per = groups.float().repeat_interleave(INT4_GROUP, dim=-2)[..., :head_dim, :]
    return per[..., 0], per[..., 1]


def int4_dequantize(packed: torch.Tensor, groups: torch.Tensor, head_dim: int) -> torch.Tensor:
    s, z = int4_group_values(groups, head_dim)
    return int4_unpack(packed, head_dim).float() * s + z


def int4_block_ranges(new_lo: torch.Tensor, new_hi: torch.Tensor, s: torch.Tensor, z: torch.Tensor,
                      held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A key block's per-channel (scale, minimum, widened) once new tokens with range [new_lo,
    new_hi] arrive, joined with the block's range [z, z + 15 s] where it ``held`` tokens: a
    channel not widened keeps its scale and minimum exactly (its codes stay valid)."""
    top = z + INT4_LEVELS * s
    widened = ~held | (new_lo < z) | (new_hi > top)
    lo = torch.where(held, torch.minimum(new_lo, z), new_lo)
    hi = torch.where(held, torch.maximum(new_hi, top), new_hi)
    fresh_s, fresh_z = ((hi - lo) / INT4_LEVELS).to(SCALE_DTYPE).float(), lo.to(SCALE_DTYPE).float()
    return torch.where(widened, fresh_s, s), torch.where(widened, fresh_z, z), widened


def int4_store_keys(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor) -> None:
    """Write keys x [T, Hkv, D] into an int4 cache with per-block-and-channel scales. A block's new
    tokens follow the ones it holds; those are re-quantized where the new ones widen a channel."""
    bs, d = cache.shape[1], x.shape[-1]
    page, row = slots // bs, slots % bs
    blocks, which = torch.unique(page, return_inverse=True)
    first = torch.full((len(blocks),), bs, device=slots.device).scatter_reduce(0, which, row, "amin")
    new = torch.zeros(len(blocks), bs, dtype=torch.bool, device=x.device)
    new[which, row] = True
    vals = torch.zeros(len(blocks), bs, *x.shape[1:], device=x.device)
    vals[which, row] = x.float()
    held_rows = torch.arange(bs, device=x.device)[None, :] < first[:, None]  # [P, bs]
    old_codes = int4_unpack(cache[blocks], d).float()  # [P, bs, H, D]
    s_old, z_old = scales[blocks].float().unbind(-1)  # [P, H, D] each
    inside = new[:, :, None, None]
    new_lo = torch.where(inside, vals, float("inf")).amin(1)
    new_hi = torch.where(inside, vals, float("-inf")).amax(1)
    s, z, widened = int4_block_ranges(new_lo, new_hi, s_old, z_old, (first > 0)[:, None, None])
    old = old_codes * s_old[:, None] + z_old[:, None]
    codes = torch.where(widened[:, None], _int4_code_values(old, s[:, None], z[:, None]), old_codes)
    codes = torch.where(inside, _int4_code_values(vals, s[:, None], z[:, None]), codes)
    write = held_rows | new
    rows = (blocks[:, None] * bs + torch.arange(bs, device=x.device)[None, :])[write]
    _rows(cache).index_copy_(0, rows, int4_pack(codes[write]))
    scales[blocks] = torch.stack([s, z], -1).to(SCALE_DTYPE)


def scale_strides(mode: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, ...]:
    """The kernels' five int4 scale strides (values' block, row, head; keys' block, head), checked
    against ``allocate``'s layouts; zeros for other caches."""
    if mode != KV_INT4:
        return (0,) * 5
    assert int4_keys_per_block(k_scale) and k_scale.stride()[-2:] == v_scale.stride()[-2:] == (2, 1)
    return (*v_scale.stride()[:3], *k_scale.stride()[:2])


def int4_keys_per_block(scales: torch.Tensor) -> bool:
    """Whether int4 scales are a key cache's [blocks, Hkv, D, 2] rather than a value cache's."""
    return scales.dim() == 4


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [slots, ...], FP8 seen as bytes (not every device indexes FP8)."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.view(torch.uint8) if kv_mode(cache) == KV_FP8 else flat


def store(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
          transform: torch.Tensor | None = None) -> None:
    """Write keys or values [T, Hkv, D] into their slots as the cache's dtype says (FP8 keys
    turned first when ``transform`` is given)."""
    mode = kv_mode(cache)
    x = transform_keys(x, transform)
    if mode == KV_FP8:
        _rows(cache).index_copy_(0, slots, fp8_quantize(x, scales, cache.dtype).view(torch.uint8))
    elif mode == KV_INT4 and int4_keys_per_block(scales):
        int4_store_keys(x, cache, scales, slots)
    elif mode == KV_INT4:
        packed, groups = int4_quantize(x)
        _rows(cache).index_copy_(0, slots, packed)
        scales.view(-1, *scales.shape[2:]).index_copy_(0, slots, groups)
    else:
        _rows(cache).index_copy_(0, slots, x.to(cache.dtype))


def pages(cache: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """cache[index] (index selects blocks), dequantized to float32; a plain cache keeps its dtype."""
    mode = kv_mode(cache)
    if mode == KV_FP8:
        return take_blocks(cache.view(torch.uint8), index).view(cache.dtype).float() * scales
    if mode == KV_INT4 and int4_keys_per_block(scales):
        s, z = take_blocks(scales, index).float().unbind(-1)  # [..., H, D]: every token of a block alike
        return int4_unpack(take_blocks(cache, index), head_dim).float() * s.unsqueeze(-3) + z.unsqueeze(-3)
    if mode == KV_INT4:
        return int4_dequantize(take_blocks(cache, index), take_blocks(scales, index), head_dim)
    return take_blocks(cache, index)


def take_blocks(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for an index of any shape over t's first dimension, as index_select: on a CPU
    advanced indexing copied a decode batch's pages five times slower."""
    return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])


def fp8_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A measured FP8 scale: the measured largest magnitude maps to the format's largest value
    over FP8_HEADROOM (values beyond the format's largest saturate)."""
    return (amax.float() * FP8_HEADROOM / fp8_max(dtype)).clamp_min(MIN_FP8_SCALE)


# ----------------------------------------------------------------------------- Triton helpers

@triton.jit
def int4_codes(x, s, z):
    """4-bit codes (int32) of x for a group's scale s and minimum z (fp32, broadcast)."""
    c = tl.minimum(tl.maximum(tl.floor((x - z) / s + 0.5), 0.0), 15.0)
    return tl.where(s > 0.0, c, 0.0).to(tl.int32)


@triton.jit
def int4_block_range(x, m, s, z, held):
    """``int4_block_ranges`` for one head of a key block: new values x [N, C] (mask m), the
    block's s, z [C], ``held``. -> (scale, minimum, widened), [C] each."""
    new_lo = tl.min(tl.where(m, x, float("inf")), 0)
    new_hi = tl.max(tl.where(m, x, float("-inf")), 0)
    top = z + 15.0 * s
    widened = (new_lo < z) | (new_hi > top) | (held == 0)
    lo = tl.where(held, tl.minimum(new_lo, z), new_lo)
    hi = tl.where(held, tl.maximum(new_hi, top), new_hi)
    fresh_s = ((hi - lo) / 15.0).to(tl.float16).to(tl.float32)
    fresh_z = lo.to(tl.float16).to(tl.float32)
    return tl.where(widened, fresh_s, s), tl.where(widened, fresh_z, z), widened


@triton.jit
def _per_channel(g, BLOCK_H: tl.constexpr, NG: tl.constexpr, BLOCK_P: tl.constexpr):
    """[BLOCK_H, NG] group values -> [BLOCK_H, BLOCK_P], each byte's (16 a group)."""
    return tl.reshape(tl.broadcast_to(g[:, :, None], (BLOCK_H, NG, 16)), (BLOCK_H, BLOCK_P))


@triton.jit
def int4_store_groups(x_even, x_odd, m_even, m_odd, data_ptrs, group_ptrs, hmask,
                      HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    """Quantize each head's row of a token, given as even and odd elements [BLOCK_H, BLOCK_P]
    with masks, storing packed bytes at data_ptrs and each group's (scale, minimum) at group_ptrs."""
    lo = tl.minimum(tl.where(m_even, x_even, float("inf")), tl.where(m_odd, x_odd, float("inf")))
    hi = tl.maximum(tl.where(m_even, x_even, float("-inf")), tl.where(m_odd, x_odd, float("-inf")))
    lo = tl.min(tl.reshape(lo, (BLOCK_H, BLOCK_P // 16, 16)), 2)
    hi = tl.max(tl.reshape(hi, (BLOCK_H, BLOCK_P // 16, 16)), 2)
    scale = ((hi - lo) / 15.0).to(tl.float16)
    zero = lo.to(tl.float16)
    offs_g = tl.arange(0, BLOCK_P // 16)
    gp = group_ptrs[:, None] + 2 * offs_g[None, :]
    gmask = hmask[:, None] & (offs_g * 32 < HEAD_DIM)[None, :]
    tl.store(gp, scale, mask=gmask)
    tl.store(gp + 1, zero, mask=gmask)
    s = _per_channel(scale.to(tl.float32), BLOCK_H, BLOCK_P // 16, BLOCK_P)
    z = _per_channel(zero.to(tl.float32), BLOCK_H, BLOCK_P // 16, BLOCK_P)
    packed = int4_codes(x_even, s, z) | (int4_codes(x_odd, s, z) << 4)
    tl.store(data_ptrs, packed.to(tl.uint8), mask=m_even)


@triton.jit
def int4_load_codes(ptr, byte_off, tmask, head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, OUT: tl.constexpr):
    """Codes [BLOCK_N, BLOCK_D] as exact values in OUT: one load of bytes a row, split in registers."""
    offs_b = tl.arange(0, BLOCK_D // 2)
    b = tl.load(ptr + byte_off[:, None] + offs_b[None, :], mask=tmask[:, None] & (offs_b * 2 < head_dim)[None, :],
                other=0)
    return tl.reshape(tl.join(small_int_to_float(b & 15, OUT), small_int_to_float(b >> 4, OUT)),
                      (BLOCK_N, BLOCK_D))  # element 2j, then 2j + 1


@triton.jit
def int4_load_rows(ptr, g_ptr, byte_off, grp_off, tmask, head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   OUT: tl.constexpr):
    """Values dequantized [BLOCK_N, BLOCK_D] in OUT (float16 beside a 16-bit query, or float32):
    each row one load of bytes and one of each group's (scale, minimum); BLOCK_D >= 32."""
    codes = int4_load_codes(ptr, byte_off, tmask, head_dim, BLOCK_N, BLOCK_D, OUT)
    tl.static_assert(BLOCK_D >= 32)  # paged_attention.head_block says why
    NG: tl.constexpr = BLOCK_D // 32
    offs_g = tl.arange(0, NG)
    gp = g_ptr + grp_off[:, None] + 2 * offs_g[None, :]
    gmask = tmask[:, None] & (offs_g * 32 < head_dim)[None, :]
    s = tl.load(gp, mask=gmask, other=0.0).to(OUT)
    z = tl.load(gp + 1, mask=gmask, other=0.0).to(OUT)
    return tl.reshape(tl.reshape(codes, (BLOCK_N, NG, 32)) * s[:, :, None] + z[:, :, None], (BLOCK_N, BLOCK_D))


@triton.jit
def int4_block_scales(g_ptr, block_off, channels, cmask, OUT: tl.constexpr):
    """Key blocks' scales and minimums [NB, C] in OUT, one 32-bit word a channel (4-byte loads,
    which the pipeliner copies ahead; it leaves 2-byte ones in the loop)."""
    words = (g_ptr + block_off).to(tl.pointer_type(tl.int32), bitcast=True)
    w = tl.load(words[:, None] + channels[None, :], mask=cmask[None, :], other=0)
    s = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    z = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return s.to(OUT), z.to(OUT)


@triton.jit
def int4_per_block(codes, s, z):
    """Codes [BLOCK_N, C] scaled by their blocks' [NB, C] scales and minimums, the tile viewed as
    [NB, BLOCK_N / NB, C] so each block's row broadcasts without copies."""
    NB: tl.constexpr = s.shape[0]
    N: tl.constexpr = codes.shape[0]
    C: tl.constexpr = codes.shape[1]
    x = tl.reshape(codes, (NB, N // NB, C)) * s[:, None, :] + z[:, None, :]
    return tl.reshape(x, (N, C))


# Packed page reads (the decode configs' "packed"): PTX converts a 32-bit word at a time in the
# registers the load left it in, so the compiler cannot move the conversion past the layout
# change to the dot's operand. ASM=False: the same values in Triton operations (interpreter).

@triton.jit
def fp8_to_f16(x, ASM: tl.constexpr):
    """An FP8 tile (e4m3 or e5m2, the last dimension a multiple of 4) as float16, exactly."""
    if ASM:
        if x.dtype == tl.float8e5:
            y = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
        else:
            y = tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)
    else:
        y = x.to(tl.float16)
    return y


def _int4_unpack_ptx(word_order: bool, scaled: bool) -> str:
    """PTX of ``int4_bytes_to_f16`` (scaled) and ``int4_bytes_to_codes``: a word of codes -> four
    float16 pairs, each code ORed into a power of two's mantissa, then one packed subtract (and FMA)."""
    out = ("$0", "$1", "$2", "$3")
    if word_order:
        text = ("{ .reg .b32 w1, k, c; mov.b32 k, 0x64006400; mov.b32 c, 0x54005400; shr.b32 w1, $4, 8;"
                " lop3.b32 $0, $4, 0x000F000F, k, 0xEA; lop3.b32 $1, w1, 0x000F000F, k, 0xEA;"
                " lop3.b32 $2, $4, 0x00F000F0, c, 0xEA; lop3.b32 $3, w1, 0x00F000F0, c, 0xEA;")
        work, bias = out, ("k", "k", "c", "c")
    else:
        text = ("{ .reg .b32 t0, t1, u0, u1, k; mov.b32 k, 0x64006400;"
                " prmt.b32 t0, $4, 0, 0x5150; prmt.b32 t1, $4, 0, 0x5352;"
                " shr.b32 u0, t0, 4; shr.b32 u1, t1, 4;"
                " lop3.b32 t0, t0, 0x000F000F, k, 0xEA; lop3.b32 t1, t1, 0x000F000F, k, 0xEA;"
                " lop3.b32 u0, u0, 0x000F000F, k, 0xEA; lop3.b32 u1, u1, 0x000F000F, k, 0xEA;")
        work, bias = ("t0", "t1", "u0", "u1"), ("k",) * 4
    codes = work if scaled else out
    text += "".join(f" sub.f16x2 {c}, {w}, {b};" for c, w, b in zip(codes, work, bias))
    if scaled:
        text += "".join(f" fma.rn.f16x2 {o}, {w}, {s}, {z};"
                        for o, w, s, z in zip(out, work, ("$5", "$6", "$5", "$6"), ("$7", "$8", "$7", "$8")))
    return text + " }"


_INT4_F16_WORDS = tl.constexpr(_int4_unpack_ptx(True, True))
_INT4_F16_CHANNELS = tl.constexpr(_int4_unpack_ptx(False, True))
_INT4_CODES_WORDS = tl.constexpr(_int4_unpack_ptx(True, False))
_INT4_CODES_CHANNELS = tl.constexpr(_int4_unpack_ptx(False, False))


@triton.jit
def int4_bytes_to_f16(b, s, z, ASM: tl.constexpr, PINNED: tl.constexpr = False, WORD_ORDER: tl.constexpr = False):
    """Packed int4 bytes b and each byte's group scale s and minimum z (float16) -> (low nibbles,
    high nibbles) as code * s + z in float16, two values per instruction with ASM. PINNED keeps the
    PTX in b's load layout (else the compiler pulls the dot's layout back to the bytes). WORD_ORDER
    (the split read): bytes come back as (0, 2, 1, 3) (``int4_word_order``), which needs no byte
    permutes; a word's four bytes must then share a group."""
    if ASM:
        if WORD_ORDER:
            lo, hi = tl.inline_asm_elementwise(
                _INT4_F16_WORDS, "=r,=r,=r,=r,r,r,r,r,r", [b, s, z],
                dtype=(tl.float16, tl.float16), is_pure=not PINNED, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(
                _INT4_F16_CHANNELS, "=r,=r,=r,=r,r,r,r,r,r", [b, s, z],
                dtype=(tl.float16, tl.float16), is_pure=not PINNED, pack=4)
    else:
        lo = small_int_to_float(b & 15, tl.float16) * s + z
        hi = small_int_to_float(b >> 4, tl.float16) * s + z
        if WORD_ORDER:
            lo, hi = _in_word_order(lo), _in_word_order(hi)
    return lo, hi


@triton.jit
def int4_bytes_to_codes(b, ASM: tl.constexpr, WORD_ORDER: tl.constexpr = False):
    """``int4_bytes_to_f16`` unscaled, for keys (scaled per block after: ``int4_per_block``)."""
    if ASM:
        if WORD_ORDER:
            lo, hi = tl.inline_asm_elementwise(
                _INT4_CODES_WORDS, "=r,=r,=r,=r,r", [b],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(
                _INT4_CODES_CHANNELS, "=r,=r,=r,=r,r", [b],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        lo = small_int_to_float(b & 15, tl.float16)
        hi = small_int_to_float(b >> 4, tl.float16)
        if WORD_ORDER:
            lo, hi = _in_word_order(lo), _in_word_order(hi)
    return lo, hi


@triton.jit
def int4_word_order(j):
    """The byte index j of a WORD_ORDER tile holds: j with its two lowest bits swapped (its own inverse)."""
    return (j & ~3) | ((j & 1) << 1) | ((j >> 1) & 1)


@triton.jit
def _in_word_order(x):
    """A [rows, bytes] tile rearranged as int4_word_order says (the interpreter's PTX stand-in)."""
    n: tl.constexpr = x.shape[0]
    p: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, (n, p // 4, 2, 2)), (0, 1, 3, 2)), (n, p))


@triton.jit
def int4_load_rows_split(ptr, g_ptr, byte_off, grp_off, tmask, head_dim, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, ASM: tl.constexpr, PINNED: tl.constexpr = False,
                         WORD_ORDER: tl.constexpr = False):
    """``int4_load_rows`` in float16, packed, as two [BLOCK_N, BLOCK_D // 2] tiles, the even and
    the odd channels in the PTX's order; every load at least 4 bytes wide, so it pipelines."""
    NG: tl.constexpr = BLOCK_D // 32
    offs_b = tl.arange(0, BLOCK_D // 2)
    # (masks as index < bound: the compiler sees them constant over a vector, as not for 2 * index)
    b = tl.load(ptr + byte_off[:, None] + offs_b[None, :],
                mask=tmask[:, None] & (offs_b < (head_dim + 1) // 2)[None, :], other=0)
    offs_g = tl.arange(0, NG)
    words = (g_ptr + grp_off).to(tl.pointer_type(tl.int32), bitcast=True)  # grp_off is even
    w = tl.load(words[:, None] + offs_g[None, :], mask=tmask[:, None] & (offs_g < (head_dim + 31) // 32)[None, :],
                other=0)
    s = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    z = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, 16)), (BLOCK_N, BLOCK_D // 2))
    z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, NG, 16)), (BLOCK_N, BLOCK_D // 2))
    return int4_bytes_to_f16(b, s, z, ASM, PINNED, WORD_ORDER)


@triton.jit
def int4_load_rows_packed(ptr, g_ptr, byte_off, grp_off, tmask, head_dim, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr, ASM: tl.constexpr):
    """``int4_load_rows_split``'s two tiles interleaved back into channel order."""
    lo, hi = int4_load_rows_split(ptr, g_ptr, byte_off, grp_off, tmask, head_dim, BLOCK_N, BLOCK_D, ASM)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_D))  # element 2j, then 2j + 1


@triton.jit
def int4_load_key_rows_split(ptr, byte_off, tmask, head_dim, s_lo, z_lo, s_hi, z_hi, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, ASM: tl.constexpr, WORD_ORDER: tl.constexpr = False):
    """Keys as ``int4_load_rows_split`` reads values, scaled per block and channel by the
    tile's (s_lo, z_lo) for the low nibbles' channels and (s_hi, z_hi) for the high ones'."""
    offs_b = tl.arange(0, BLOCK_D // 2)
    b = tl.load(ptr + byte_off[:, None] + offs_b[None, :],
                mask=tmask[:, None] & (offs_b < (head_dim + 1) // 2)[None, :], other=0)
    lo, hi = int4_bytes_to_codes(b, ASM, WORD_ORDER)
    return int4_per_block(lo, s_lo, z_lo), int4_per_block(hi, s_hi, z_hi)
