"""Quantized KV cache (--kv-cache-dtype fp8, fp8_e5m2, int4): the storage math, the Triton
store and attention kernels against the torch reference (in the interpreter on CPU, at real
sizes on a GPU), and the KV sizing.

GPU (real sizes): python -m pytest tests/kernels/test_kv_quant.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvship.kernels import kv_quant as kvq
from kvship.kernels import paged_attention as pa
from kvship.kernels import rotary
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.norm import rms_norm_torch
from sm90_compile import attention_types, compile_in_child, decode_types, ints
from test_kernels import DEV, GPU, check_mixed_step, close, make_paged, mixed_step_lens, qk_norm_weights, store_inputs

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

KV_DTYPES = ["fp8_e4m3", "fp8_e5m2", "int4"]
DTYPE = torch.bfloat16 if GPU else torch.float32
# head sizes: powers of two, a non-power of two (80), and an odd one for the 4-bit packing
HEADS = [(9, 3, 64), (8, 2, 80), (4, 2, 33), (4, 2, 16)] if not GPU else [(32, 8, 128), (9, 3, 64), (32, 8, 80)]
FP8_SCALE = 0.02  # randn values reach ~4.5 > 448 * 0.02 / 2: the e4m3 range is exercised, saturation too


def quantize_cache(cache: torch.Tensor, kv_dtype: str, scale: float = FP8_SCALE, keys: bool = False):
    """A plain paged cache [blocks, bs, Hkv, D] in kv_dtype's layout: (cache, scales); int4
    keys per block and channel, each block stored whole."""
    if kv_dtype == "int4" and keys:
        nb, bs, hkv, d = cache.shape
        codes = torch.zeros(nb, bs, hkv, -(-d // 2), dtype=torch.uint8, device=cache.device)
        scales = torch.zeros(nb, hkv, d, 2, dtype=kvq.SCALE_DTYPE, device=cache.device)
        kvq.int4_store_keys(cache.flatten(0, 1), codes, scales, torch.arange(nb * bs, device=cache.device))
        return codes, scales
    if kv_dtype == "int4":
        return kvq.int4_quantize(cache)
    s = torch.tensor([scale], device=cache.device)
    return kvq.fp8_quantize(cache, s, kvq.FP8_DTYPES[kv_dtype]), s


def quant_paged(q_lens, ctx, hq, hkv, d, block_size, kv_dtype, seed, dtype=DTYPE):
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, hq, hkv, d, block_size, dtype, seed)
    (kq, ks), (vq, vs) = quantize_cache(kc, kv_dtype, keys=True), quantize_cache(vc, kv_dtype, 2 * FP8_SCALE)
    return q, kq, vq, ks, vs, bt, sl, cu


def test_int4_roundtrip_and_packing():
    """Codes pack two a byte (element 2i low nibble), odd lengths pad one nibble, groups of 32
    channels (a short last one), the error of each element is at most half a step, constant
    groups come back exactly."""
    x = torch.randn(5, 3, 33) * torch.tensor([1.0, 10.0, 0.01])[None, :, None]
    x[..., 32] = 100.0  # alone in its group: exact, and no effect on the first group's scale
    packed, groups = kvq.int4_quantize(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 17) and groups.shape == (5, 3, 2, 2)
    y = kvq.int4_dequantize(packed, groups, 33)
    step, zero = kvq.int4_group_values(groups, 33)
    assert ((y - x).abs() <= step * 0.5 + 2e-3 * x.abs().amax(-1, keepdim=True)).all()
    assert (y[..., 32] == 100.0).all()
    first = x[..., :32]
    assert torch.equal(groups[..., 0, 0], ((first.amax(-1) - first.amin(-1)) / 15).half())
    codes = torch.floor((x - zero) / step + 0.5).clamp(0, 15).to(torch.uint8)
    assert torch.equal(packed[..., 0], codes[..., 0] | (codes[..., 1] << 4))
    assert torch.equal(packed[..., 16], codes[..., 32])  # the odd element's partner nibble is 0
    const = torch.full((2, 1, 8), 0.75)
    assert torch.equal(kvq.int4_dequantize(*kvq.int4_quantize(const), 8), const)


def _run_ptx(text: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The few PTX instructions of kv_quant._int4_unpack_ptx, executed on uint32 arrays (one
    element per thread): mov, shr, lop3 (0xEA: a & b | c), prmt (byte select), and sub / fma on
    float16 pairs. Any other instruction fails the test."""
    regs = dict(regs)
    f16 = lambda x: x.astype(np.uint32).view(np.uint16).view(np.float16).reshape(-1, 2)  # noqa: E731
    u32 = lambda h: h.astype(np.float16).reshape(-1).view(np.uint16).view(np.uint32)  # noqa: E731
    val = lambda a: regs[a] if a in regs else np.uint32(int(a, 0))  # noqa: E731
    for ins in text.strip("{} ").split(";"):
        if not ins.strip() or ins.strip().startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[d] = np.full_like(regs["$4"], int(a[0], 0))
        elif op == "shr.b32":
            regs[d] = val(a[0]) >> np.uint32(int(a[1]))
        elif op == "lop3.b32":
            assert a[3] == "0xEA"
            regs[d] = (val(a[0]) & val(a[1])) | val(a[2])
        elif op == "prmt.b32":
            both = val(a[0]).astype(np.uint64) | (np.uint64(int(a[1], 0)) << np.uint64(32))
            sel = int(a[2], 0)
            regs[d] = sum(((both >> np.uint64(8 * ((sel >> 4 * i) & 7))) & np.uint64(255)) << np.uint64(8 * i)
                          for i in range(4)).astype(np.uint32)
        elif op == "sub.f16x2":
            regs[d] = u32(f16(val(a[0])).astype(np.float32) - f16(val(a[1])).astype(np.float32))
        elif op == "fma.rn.f16x2":
            x, y, z = (f16(val(r)).astype(np.float64) for r in a)
            regs[d] = u32(x * y + z)
        else:
            raise AssertionError(f"unexpected PTX {op!r}")
    return regs


@pytest.mark.parametrize("word_order", [True, False], ids=["word-order", "channel-order"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "codes"])
def test_int4_unpack_ptx(word_order, scaled):
    """The PTX behind int4_bytes_to_f16 / int4_bytes_to_codes (kv_quant._int4_unpack_ptx), which
    the interpreter does not run, executed here on every byte value: each of the four bytes of a
    word comes back as its two codes (times its group's scale, plus its minimum), low nibbles in
    $0-$1 and high ones in $2-$3, bytes in the order (0, 2, 1, 3) for the split read
    (int4_word_order) and (0, 1, 2, 3) otherwise."""
    x = np.arange(256, dtype=np.uint32)
    b = np.stack([x, (7 * x + 3) % 256, (13 * x + 5) % 256, (29 * x + 11) % 256], -1)  # each a permutation
    word = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
    scale, low = np.float16(0.375), np.float16(-1.25)  # one group a word; exact products in float16
    pair = lambda v: np.full(256, np.array([v, v], np.float16).view(np.uint32)[0])  # noqa: E731
    regs = {"$4": word, "$5": pair(scale), "$6": pair(scale), "$7": pair(low), "$8": pair(low)}
    out = _run_ptx(kvq._int4_unpack_ptx(word_order, scaled), regs)
    got = np.concatenate([out[r].view(np.float16).reshape(256, 2) for r in ("$0", "$1", "$2", "$3")], -1)
    order = [0, 2, 1, 3] if word_order else [0, 1, 2, 3]
    codes = np.concatenate([b[:, order] & 15, b[:, order] >> 4], -1).astype(np.float32)
    want = codes * np.float32(scale) + np.float32(low) if scaled else codes
    np.testing.assert_array_equal(got.astype(np.float32), want)
    assert order == ([kvq.int4_word_order(j) for j in range(4)] if word_order else order)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_store_saturates_and_scales(kv_dtype):
    dtype = kvq.FP8_DTYPES[kv_dtype]
    s = torch.tensor([0.5])
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    y = kvq.fp8_quantize(x, s, dtype).float() * s
    assert torch.equal(y, torch.tensor([kvq.fp8_max(dtype) * 0.5, -kvq.fp8_max(dtype) * 0.5, 3.0, 0.0]))


@pytest.mark.parametrize("d", [64, 80])
def test_key_rotation_is_orthogonal_and_preserves_scores(d):
    r = kvq.key_rotation(d, torch.device("cpu"))
    torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-6, rtol=0)
    q, k = torch.randn(5, 2, d), torch.randn(5, 2, d)
    torch.testing.assert_close((kvq.transform_queries(q, r) * (k @ r)).sum(-1), (q * k).sum(-1), atol=1e-4, rtol=1e-4)
    if d == 64:
        assert torch.allclose(r.abs(), torch.full_like(r, d**-0.5))  # Hadamard: every channel spreads evenly
        # the rotary kernel makes R from the signs and this one magnitude: R's own float32 value
        assert torch.equal(r.abs(), torch.full_like(r, kvq.hadamard_entry(d)))
    else:
        assert kvq.hadamard_entry(d) == 0.0  # R is read


def test_int4_keys_per_block_and_channel():
    """int4 keys: a block stored whole has each channel's scale and minimum over its tokens
    (every value within half a step); tokens arriving one by one keep the codes of channels they
    do not widen, re-quantize the ones they widen, and end within one step of a whole block's
    range; the first token of a block starts a fresh range whatever the block held before."""
    g = torch.Generator().manual_seed(7)
    bs, hkv, d = 16, 2, 40
    x = torch.randn(2 * bs, hkv, d, generator=g) * torch.rand(d, generator=g) * 3 + torch.randn(d, generator=g) * 5
    whole = quantize_cache(torch.zeros(2, bs, hkv, d), "int4", keys=True)
    codes, scales = whole
    codes.fill_(0xFF)  # old contents: a fresh range must not read them
    scales.fill_(100.0)
    kvq.int4_store_keys(x, codes, scales, torch.arange(2 * bs))
    y = kvq.pages(codes, scales, torch.arange(2), d).flatten(0, 1)
    blocks = x.unflatten(0, (2, bs))
    lo, hi = blocks.amin(1), blocks.amax(1)
    torch.testing.assert_close(scales[..., 0].float(), ((hi - lo) / 15).half().float(), atol=0, rtol=0)
    torch.testing.assert_close(scales[..., 1].float(), lo.half().float(), atol=0, rtol=0)
    step = scales[:, None, ..., 0].float().expand(2, bs, hkv, d).flatten(0, 1)
    assert ((y - x).abs() <= step * 0.5 + 1e-3 * x.abs()).all()

    one = quantize_cache(torch.zeros(2, bs, hkv, d), "int4", keys=True)
    widened = False
    for i in range(2 * bs):
        b, r = divmod(i, bs)
        codes_before, scales_before = one[0][b].clone(), one[1][b].clone()
        kvq.int4_store_keys(x[i:i + 1], *one, torch.tensor([i]))
        if r:  # channels the token left alone keep their scale and every code
            s0, z0 = scales_before[..., 0].float(), scales_before[..., 1].float()
            kept = (x[i] >= z0) & (x[i] <= z0 + 15 * s0)
            assert torch.equal(one[1][b][..., 0][kept], scales_before[..., 0][kept])
            now, then = kvq.int4_unpack(one[0][b, :r], d), kvq.int4_unpack(codes_before[:r], d)
            assert torch.equal(now[:, kept], then[:, kept])
            widened |= bool((~kept).any())
    assert widened  # (the test saw both cases)
    z = kvq.pages(*one, torch.arange(2), d).flatten(0, 1)
    # the same range in the end, but for the float16 roundings each widening took
    torch.testing.assert_close(one[1].float(), scales.float(), atol=1e-3, rtol=1e-2)
    assert ((z - x).abs() <= step * 1.5 + 1e-3 * x.abs()).all()  # re-quantized: within 1.5 steps


def test_kv_bytes():
    """At the same memory, 2x the blocks for fp8 and 2.9x for int4 (Llama-3-8B heads, bf16,
    blocks of 16: a token's key takes 64 bytes of codes and 32 of its block's per-channel
    scales, its value 64 and 4 groups of 4 bytes, against 256 bytes each)."""
    def per_block(kind):
        return kvq.bytes_per_block_head(kind, 128, torch.bfloat16, 16)
    assert per_block("auto") / per_block("fp8") == 2
    assert per_block("auto") / per_block("int4") == 2 * 256 / (96 + 80)
    for kind in ["auto", "fp8", "fp8_e5m2", "int4"]:
        for block_size in (16, 32):
            k, v, ks, vs = kvq.allocate(kind, 3, block_size, 2, 80, torch.bfloat16, "cpu")
            per_head = (k.nbytes + v.nbytes + (ks.nbytes + vs.nbytes if ks is not None else 0)) // (3 * 2)
            assert per_head == kvq.bytes_per_block_head(kind, 80, torch.bfloat16, block_size)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_reference_reads_what_it_stored(kv_dtype):
    """paged_attention_torch over a quantized cache equals it over the dequantized values."""
    q, kq, vq, ks, vs, bt, sl, cu = quant_paged([5, 1], [20, 9], 4, 2, 16, 8, kv_dtype, seed=1)
    blocks = torch.arange(kq.shape[0], device=kq.device)
    kd, vd = kvq.pages(kq, ks, blocks, 16), kvq.pages(vq, vs, blocks, 16)
    ref = pa.paged_attention_torch(q, kd.to(q.dtype), vd.to(q.dtype), bt, sl, cu, 0.25)
    got = pa.paged_attention_torch(q, kq, vq, bt, sl, cu, 0.25, ks, vs)
    close(got, ref, q.dtype, "quantized reference")


@needs_triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_decode_kernel(hq, hkv, d, kv_dtype):
    ctx = [1, 17, 100, 33] if not GPU else [1, 17, 1000, 4096, 2049, 513, 33, 8192]
    q, kq, vq, ks, vs, bt, sl, cu = quant_paged([1] * len(ctx), ctx, hq, hkv, d, 16, kv_dtype, seed=hq + d)
    ref = pa.paged_attention_torch(q, kq, vq, bt, sl, cu, d**-0.5, ks, vs)
    for ns in [None, 1]:  # CPU: None means several splits and their reduce
        out = pa.paged_attention_triton(q, kq, vq, bt, sl, cu, d**-0.5, 1, num_splits=ns, k_scale=ks, v_scale=vs)
        close(out, ref, DTYPE, f"decode {kv_dtype} splits={ns}")


@needs_triton
@pytest.mark.skipif(GPU, reason="on a GPU test_decode_kernel runs bf16 queries already")
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_kernel_16bit_query(kv_dtype, dtype):
    """Beside a 16-bit query the kernels dot quantized pages in fp16 (int4 pages dequantized in
    fp16 arithmetic): the path the GPU runs, here in the interpreter."""
    q, kq, vq, ks, vs, bt, sl, cu = quant_paged([1, 1, 1], [1, 40, 97], 8, 2, 64, 16, kv_dtype, seed=5, dtype=dtype)
    ref = pa.paged_attention_torch(q, kq, vq, bt, sl, cu, 64**-0.5, ks, vs)
    out = pa.paged_attention_triton(q, kq, vq, bt, sl, cu, 64**-0.5, 1, k_scale=ks, v_scale=vs)
    close(out, ref, dtype, f"decode {kv_dtype} {dtype}")


@needs_triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 2, 80), (4, 2, 33), (4, 2, 16)])
def test_decode_kernel_packed(hq, hkv, d, kv_dtype):
    """The decode kernel's packed page reads (decode config "packed": FP8 converted in the load's
    registers, int4 codes and group words loaded whole; True: keys and values, "values": values
    alone, "split": int4 pages left as even and odd channels, two dots each): the same values as
    the reference beside
    fp16 and bf16 queries, for every head size (FP8 at 33: an odd byte; int4 at 80, 33 and 16
    falls back to the reads as stored), and beside a float32 query (--dtype float32 on a GPU),
    which reads as stored whatever the config says. The interpreter runs the Triton twin of the
    PTX (the PTX itself is compiled by test_kernels_compile_for_sm90 and timed by
    bench/kv_attention_sweep.py)."""
    for dtype, seed in ((torch.float16, d), (torch.bfloat16, d + 1), (torch.float32, d + 2)):
        q, kq, vq, ks, vs, bt, sl, cu = quant_paged([1, 1, 1], [1, 40, 97], hq, hkv, d, 16, kv_dtype, seed=seed,
                                                    dtype=dtype)
        ref = pa.paged_attention_torch(q, kq, vq, bt, sl, cu, d**-0.5, ks, vs)
        for packed in (True, "values", "split"):  # "split" beside FP8 pages: True
            cfg = {**pa.DECODE_CONFIGS[kvq.kv_mode(kq)], "packed": packed}
            out = pa.paged_attention_triton(q, kq, vq, bt, sl, cu, d**-0.5, 1, k_scale=ks, v_scale=vs,
                                            decode_config=cfg)
            # a float32 query's dots take TF32 on a GPU (10 mantissa bits, as fp16's)
            bound = torch.float16 if GPU and dtype == torch.float32 else dtype
            close(out, ref, bound, f"packed={packed} decode {kv_dtype} {dtype}")


def test_int4_tiles_hold_a_whole_group():
    """int4 pages are read in tiles of at least 32 channels (a 16-channel K gave the sm_90
    compiler's q @ k dot a broadcast operand layout: pa.head_block); other layouts keep the head
    size rounded up to a power of two."""
    assert [pa.head_block(d, kvq.KV_INT4) for d in (9, 16, 32, 33, 80, 128)] == [32, 32, 32, 64, 128, 128]
    assert [pa.head_block(d, m) for d in (16, 80) for m in (kvq.KV_PLAIN, kvq.KV_FP8)] == [16, 16, 128, 128]


@needs_triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_prefill_kernel(hq, hkv, d, kv_dtype):
    """Fresh prompt, cached prefix / later chunk, a decode token, an empty sequence."""
    if GPU:
        q_lens, ctx = [700, 256, 1, 0, 2048], [700, 2000, 513, 40, 8192]
    else:
        q_lens, ctx = [20, 7, 1, 0, 33], [20, 50, 17, 9, 40]
    q, kq, vq, ks, vs, bt, sl, cu = quant_paged(q_lens, ctx, hq, hkv, d, 16, kv_dtype, seed=3 * hq + d)
    ref = pa.paged_attention_torch(q, kq, vq, bt, sl, cu, d**-0.5, ks, vs)
    out = pa.paged_attention_triton(q, kq, vq, bt, sl, cu, d**-0.5, max(q_lens), k_scale=ks, v_scale=vs)
    close(out, ref, DTYPE, f"prefill {kv_dtype}")


@needs_triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS[:2])
def test_mixed_step_kernels(hq, hkv, d, kv_dtype, monkeypatch):
    """Quantized pages in a step that mixes decodes with prompt chunks: the decodes through
    the decode kernel (its packed page reads), the chunks through the prefill kernel."""
    q_lens, ctx = mixed_step_lens()
    q, kq, vq, ks, vs, bt, sl, cu = quant_paged(q_lens, ctx, hq, hkv, d, 16, kv_dtype, seed=5 * hq + d)
    check_mixed_step(monkeypatch, q, kq, vq, bt, sl, cu, q_lens, d**-0.5, DTYPE, f"mixed step {kv_dtype}",
                     k_scale=ks, v_scale=vs)


@needs_triton
@pytest.mark.parametrize("kv_dtype,turn", [("fp8_e4m3", True), ("fp8_e5m2", True), ("fp8_e4m3", False),
                                           ("int4", False)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 80)] if not GPU else [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_store_kernel(norm, hq, hkv, d, kv_dtype, turn):
    """The fused (per-head q/k norm +) rotary + quantizing store writes what the reference
    writes (the same codes but for an fp32 division's last bit, which may move a value across a
    rounding boundary: a handful of codes one step apart) and leaves padding slots (-1) alone;
    FP8 keys turned by the Hadamard (d 64) or QR (d 80) matrix as the engine stores them, or not.
    int4 keys go in per block: the slots are then sequences' runs (_sequence_slots), some
    starting in a block that holds tokens already (whose codes the store re-quantizes where the
    new ones widen a channel: both sides from the same old contents).
    Keys in a 16-bit dtype may themselves round one step apart, normed (_fragile_heads) or
    rotated (_rotary_fragile_heads): their heads are held to a looser bound and their int4
    groups (for keys: their blocks' scales) are not compared."""
    t, nb, bs = (13, 8, 16) if not GPU else (2048, 300, 16)
    g = torch.Generator().manual_seed(d + hkv)
    cache, pos, slots, _, q, k, v = store_inputs(t, nb * bs, hq, hkv, d, DTYPE, g, gain=3.0)
    if kv_dtype == "int4":
        slots = _sequence_slots(t, nb, bs, g).to(DEV)
    qk_norm = qk_norm_weights(d, DTYPE, g) if norm else None
    kc, vc, ks, vs = kvq.allocate(kv_dtype, nb, bs, hkv, d, DTYPE, DEV)
    if ks is None:
        ks, vs = torch.tensor([FP8_SCALE], device=DEV), torch.tensor([2 * FP8_SCALE], device=DEV)
    # old contents everywhere: the padding slots must keep them
    filled = [kc, vc] + ([ks, vs] if kv_dtype == "int4" else [])
    for x in filled:
        x.normal_() if x.dtype == torch.float16 else x.view(torch.uint8).random_(0, 120)
    if kv_dtype == "int4":  # a key block's scales as a store leaves them: positive
        ks[..., 0].uniform_(0.05, 0.5)
    refs = [x.clone() for x in filled]
    rot = kvq.key_rotation(d, torch.device(DEV)) if turn else None
    q_ref = rotary.rotary_store_kv_torch(pos, q.clone(), k, v, cache, refs[0], refs[1], slots,
                                         *(refs[2:] if kv_dtype == "int4" else (ks, vs)), rot, qk_norm)
    q_got = rotary.rotary_store_kv_triton(pos, q, k, v, cache, kc, vc, slots, ks, vs, rot, qk_norm)
    close(q_got, q_ref, DTYPE, "rotated q")
    blocks = torch.arange(nb, device=DEV)
    fragile = torch.zeros(nb * bs, hkv, dtype=torch.bool, device=DEV)  # cache heads [nb, bs, hkv]
    if DTYPE != torch.float32:
        stored = slots >= 0
        heads = _rotary_fragile_heads(k, qk_norm, pos, cache, DTYPE)
        if norm:
            heads |= _fragile_heads(k, qk_norm, DTYPE)
        fragile[slots[stored]] = heads[stored]
    fragile = fragile.view(nb, bs, hkv)
    for got, ref, s, what in ((kc, refs[0], ks, "k"), (vc, refs[1], vs, "v")):
        loose = fragile if what == "k" else torch.zeros_like(fragile)
        if kv_dtype == "int4":
            s_ref = refs[2] if what == "k" else refs[3]
            compared = ~loose.any(1) if what == "k" else ~loose  # key scales: per block and head
            torch.testing.assert_close(s[compared], s_ref[compared], rtol=1e-3, atol=0, msg=f"{what} int4 scales")
            a, b = kvq.pages(got, s, blocks, d), kvq.pages(ref, s_ref, blocks, d)
            if what == "k":
                step = s_ref[:, None, ..., 0].float().abs().expand(nb, bs, hkv, d)
            else:
                step = kvq.int4_group_values(s_ref, d)[0].abs()  # (slots never written hold noise)
        else:
            a, b = kvq.pages(got, s, blocks, d), kvq.pages(ref, s, blocks, d)
            # one code step: 2^-mantissa of the value, and near zero the subnormals' fixed step
            # (a turned key rounding to 0 one way and to 2^-9 * scale the other failed on the H200)
            mant = 3 if kv_dtype == "fp8_e4m3" else 2
            sub = torch.finfo(kc.dtype).smallest_normal * 2.0**-mant * s.float()
            step = torch.maximum(b.abs() * 2.0**-mant, sub) + 1e-6
        # a key one step apart (at most 2^-7 of it, so of its head's length) moves its head's
        # stored values (turned by R: all of them) by up to that step: a few such keys a head, 2^-5
        slack = loose[..., None] * 2.0**-5 * b.norm(dim=-1, keepdim=True)
        off = (a - b).abs() > 1e-6
        assert ((a - b).abs() <= step * 1.001 + 1e-6 + slack).all(), f"{what}: more than one step apart"
        assert off.float().mean() < 0.01, f"{what}: {int(off.sum())} of {off.numel()} values differ"
        untouched = ~_stored(slots, nb * bs)
        if kv_dtype == "int4" and what == "k":  # a block's held rows are re-quantized (compared above)
            untouched &= ~_held(slots, nb, bs)
        assert torch.equal(_bytes(got)[untouched], _bytes(ref)[untouched]), f"{what}: padding slots written"


def _sequence_slots(t: int, nb: int, bs: int, g: torch.Generator) -> torch.Tensor:
    """[t] slots as sequences fill their blocks: runs of consecutive slots (one sequence's new
    tokens: a prompt chunk or a decode), each from some row of a block of its own on into fresh
    blocks, then a quarter of padding (-1) at the end, as a captured graph's batch is padded."""
    free = torch.randperm(nb, generator=g).tolist()
    slots: list[int] = []
    real = t - t // 4
    while len(slots) < real and free:
        block, row = free.pop(), int(torch.randint(0, bs, (1,), generator=g))
        for _ in range(min(int(torch.randint(1, 2 * bs, (1,), generator=g)), real - len(slots))):
            if row == bs:
                if not free:
                    break
                block, row = free.pop(), 0
            slots.append(block * bs + row)
            row += 1
    return torch.tensor(slots + [-1] * (t - len(slots)))


def _rotary_fragile_heads(k: torch.Tensor, qk_norm: rotary.QKNorm | None, pos: torch.Tensor,
                          cos_sin: torch.Tensor, dtype: torch.dtype, ulps: float = 4.0):
    """[T, Hkv]: the heads of k holding a rotated value (x1 cos - x2 sin or x2 cos + x1 sin, of
    the reference's normed key when qk_norm) that rounds to ``dtype`` one way or the other when it
    moves by ``ulps`` float32 units of its two products. The kernel computes it with a fused
    multiply-add where the compiler chooses, the reference with two roundings: on the H200 one
    such value lay exactly on a bf16 rounding midpoint (the key of token 294, head 1, d 64), and
    its head's turned FP8 codes then differed by up to two steps."""
    if qk_norm is not None:
        k = rms_norm_torch(k, qk_norm.k_weight, qk_norm.eps)
    half = k.shape[-1] // 2
    cs = cos_sin[pos].float()[:, None, :]
    cos, sin = cs[..., :half], cs[..., half:]
    x1, x2 = k[..., :half].float(), k[..., half:].float()
    fragile = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)
    for a, b in ((x1 * cos, -x2 * sin), (x2 * cos, x1 * sin)):
        y, slack = a + b, ulps * 2.0**-24 * (a.abs() + b.abs())
        fragile |= ((y - slack).to(dtype) != (y + slack).to(dtype)).any(-1)
    return fragile


def _fragile_heads(k: torch.Tensor, qk_norm: rotary.QKNorm, dtype: torch.dtype, rel: float = 2.0**-18):
    """[T, Hkv]: the heads of k holding a normed value (rms_norm_torch's arithmetic, in fp32)
    that rounds to ``dtype`` one way or the other when 1/rms moves by ``rel``. The kernel's 1/rms
    is the reference's but for its last bits (on a GPU: approximate square root and division,
    another summation order, a few units in the last place where ``rel`` allows 32 or more), so
    in these heads, and only in these, a normed key may round one step apart from the reference's."""
    kf = k.float()
    y = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + qk_norm.eps) * qk_norm.k_weight.float()
    return ((y * (1 - rel)).to(dtype) != (y * (1 + rel)).to(dtype)).any(-1)


def _stored(slots, n):
    m = torch.zeros(n, dtype=torch.bool, device=slots.device)
    m[slots[slots >= 0]] = True
    return m


def _held(slots, nb, bs):
    """[nb * bs]: the rows of each block that slots write to that come before its first written
    row (the tokens it held: an int4 key store re-quantizes them)."""
    stored = slots[slots >= 0]
    first = torch.full((nb,), bs, device=slots.device).scatter_reduce(0, stored // bs, stored % bs, "amin")
    return (torch.arange(bs, device=slots.device)[None, :] < first[:, None]).flatten()


def _bytes(cache):
    return cache.view(torch.uint8).view(cache.shape[0] * cache.shape[1], -1)


def test_cache_config_info_gauge():
    """kvship:cache_config_info, as vLLM's cache_config_info: the cache's facts as labels of a 1."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from kvship.config import EngineConfig
    from kvship.core.async_engine import EngineStats
    from kvship.server.metrics import EngineStatsCollector

    stats = EngineStats(0, 0, 5825, 0, 5825, 0, 0, 0, 0, 0)
    engine = SimpleNamespace(stats=lambda: stats, is_alive=lambda: True,
                             config=EngineConfig(kv_cache_dtype="fp8", block_size=16))
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(SimpleNamespace(engine=engine, model_name="m")))
    text = generate_latest(registry).decode()
    assert ('kvship:cache_config_info{block_size="16",cache_dtype="fp8",model_name="m",num_gpu_blocks="5825"} 1.0'
            in text), text


def _rotary_types(cache: str, scales: str, rotation: str, norm_weights: str) -> dict[str, str]:
    """The rotary + store kernel's runtime argument types beside a bf16 q, k and v."""
    return {"pos_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cs_ptr": "*fp32",
            "kc_ptr": cache, "vc_ptr": cache, "ks_ptr": scales, "vs_ptr": scales, "r_ptr": rotation,
            "slot_ptr": "*i64", "qw_ptr": norm_weights, "kw_ptr": norm_weights, "eps": "fp32",
            **ints("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs",
                   "stride_kcb", "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs", "stride_vch",
                   "stride_gb", "stride_gs", "stride_gh", "stride_ksb", "stride_ksh")}


def _sm90_specs():
    """Every store and attention kernel variant the engine launches with a quantized cache (and
    the plain one), as tests/sm90_compile.py takes them."""
    caches = {"auto": ("*bf16", "*bf16"), "fp8_e4m3": ("*fp8e4nv", "*fp32"), "fp8_e5m2": ("*fp8e5", "*fp32"),
              "int4": ("*u8", "*fp16")}
    for kv, (cache, scales) in caches.items():
        mode = {"auto": 0, "int4": 2}.get(kv, 1)
        # per-head q/k norm weights in bf16 (Qwen3) or float32 (Gemma 3's folded 1 + w), or none
        norms = [(False, "*bf16"), (True, "*bf16")] + ([(True, "*fp32")] if mode == 0 else [])
        # turned FP8 keys: by Sylvester's matrix made in registers, or by a loaded R (80-wide heads), or not
        turns = {1: [(False, 0.0), (True, kvq.hadamard_entry(128)), (True, 0.0)]}
        for (transform, r_entry), (qk_norm, w) in ((t, n) for t in turns.get(mode, [(False, 0.0)]) for n in norms):
            turn = transform and mode == 1
            types = _rotary_types(cache, scales, "*fp32" if transform else "*bf16", w)
            yield {"kernel": "kvship.kernels.rotary:_rotary_store_kv_kernel", "types": types,
                   "constexprs": dict(HQ=32, HKV=8, HALF=64, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_HQ=32,
                                      BLOCK_HKV=16 if turn else 8, BLOCK_HALF=64, BLOCK_D=128, KV_MODE=mode,
                                      FP8_E5=kv == "fp8_e5m2", TURN_K=turn, R_ENTRY=r_entry, QK_NORM=qk_norm)}
        if mode == 1:  # heads of 256 (Gemma 2 and 3), turned: the turn's tiles within a block's shared memory
            yield {"kernel": "kvship.kernels.rotary:_rotary_store_kv_kernel",
                   "types": _rotary_types(cache, scales, "*fp32", "*fp32"),
                   "constexprs": dict(HQ=16, HKV=8, HALF=128, HEAD_DIM=256, BLOCK_SIZE=16, BLOCK_HQ=16, BLOCK_HKV=16,
                                      BLOCK_HALF=128, BLOCK_D=256, KV_MODE=mode, FP8_E5=kv == "fp8_e5m2",
                                      TURN_K=True, R_ENTRY=kvq.hadamard_entry(256), QK_NORM=True)}
            fp8 = pa.DECODE_CONFIGS[mode]
            yield {"kernel": "kvship.kernels.paged_attention:_decode_kernel", "types": decode_types(cache, scales),
                   "constexprs": dict(GROUP=2, BLOCK_G=16, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16, NUM_SPLITS=8,
                                      KV_MODE=mode, BLOCK_N=fp8["block_n"],
                                      PACKED=pa.packed_read(fp8, mode, torch.bfloat16, 256)),
                   "options": {"num_warps": fp8["num_warps"], "num_stages": fp8["num_stages"]}}
        default = pa.DECODE_CONFIGS[mode]
        launched = dict(BLOCK_N=default["block_n"], PACKED=pa.packed_read(default, mode, torch.bfloat16, 128))
        for splits in (1, 8):
            yield {"kernel": "kvship.kernels.paged_attention:_decode_kernel",
                   "types": decode_types(cache, scales),
                   "constexprs": dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, NUM_SPLITS=splits,
                                      KV_MODE=mode, **launched)}
        if mode > 0:  # the default config beside a float32 query (--dtype float32): pages read as stored
            yield {"kernel": "kvship.kernels.paged_attention:_decode_kernel",
                   "types": {**decode_types(cache, scales), "q_ptr": "*fp32", "out_ptr": "*fp32"},
                   "constexprs": dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, NUM_SPLITS=8,
                                      KV_MODE=mode, BLOCK_N=default["block_n"],
                                      PACKED=pa.packed_read(default, mode, torch.float32, 128))}
        if mode > 0:  # the packed page reads (PACKED 1: keys and values, 2: values, 3: int4 split), with their PTX
            variants = ((128, 128, 1), (64, 80, 1), (128, 128, 2))
            if mode == 2:  # and the split read (PACKED 3)
                variants += ((64, 128, 3), (128, 128, 3), (64, 80, 3))
            for block_n, head_dim, packed in variants:
                yield {"kernel": "kvship.kernels.paged_attention:_decode_kernel",
                       "types": decode_types(cache, scales),
                       "constexprs": dict(GROUP=4, BLOCK_G=16, HEAD_DIM=head_dim, BLOCK_D=128, BLOCK_SIZE=16,
                                          BLOCK_N=block_n, NUM_SPLITS=8, KV_MODE=mode, PACKED=packed)}
        yield {"kernel": "kvship.kernels.paged_attention:_prefill_kernel", "types": attention_types(cache, scales),
               "constexprs": dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64,
                                  KV_MODE=mode)}


@needs_triton
@pytest.mark.timeout(900)
def test_kernels_compile_for_sm90():
    """The interpreter accepts programs the GPU compiler rejects (tests/sm90_compile.py)."""
    compile_in_child(list(_sm90_specs()))
