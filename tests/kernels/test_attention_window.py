"""Sliding-window attention, chunked local attention (Llama 4) and score soft-capping in the
paged attention kernels: the torch
reference against the definition (dense, in float64), the Triton kernels (decode split-K and
varlen prefill, in the interpreter without a GPU) against the reference, and the GELU-tanh
gated activation beside SiLU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvship.kernels import activation
from kvship.kernels import paged_attention as pa
from kvship.kernels._triton import HAS_TRITON
from test_kernels import DEV, DTYPES, GPU, close, make_paged

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
KERNEL_DTYPES = DTYPES[:1]  # the interpreter: float32 only (test_kernels.py covers float16); a GPU: bfloat16

# (window, softcap, chunk): window only, cap only, both; windows below, at and above a tile's
# width; chunks of a tile's width and across tiles' and pages' edges, one beside a window
OPTIONS = [(8, None, None), (None, 5.0, None), (5, 2.0, None), (20, None, None), (None, None, 16), (None, 3.0, 12),
           (6, None, 12)] if not GPU else [(1024, None, None), (None, 50.0, None), (4096, 50.0, None),
                                           (None, None, 1000), (None, None, 8192)]


def dense_reference(q, kc, vc, bt, sl, cu, scale, window, softcap, chunk):
    """Attention by its definition, sequence by sequence, in float64: key k is visible to the
    query at position p when k <= p and (no window or k > p - window) and (no chunk or
    k >= p - p % chunk)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // kc.shape[2]
    starts = cu.tolist()
    for b, ctx in enumerate(sl.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = pa.gather_kv(kc, bt[b], ctx).double().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = pa.gather_kv(vc, bt[b], ctx).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        visible = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
        visible &= k_pos >= q_pos - q_pos % chunk if chunk else True
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@pytest.mark.parametrize("window,softcap,chunk", OPTIONS)
def test_reference_is_the_definition(window, softcap, chunk):
    """Decode (one token each, the batched path) and prefill (chunks over cached prefixes)."""
    for q_lens, ctx in (([1, 1, 1], [3, 9, 30]), ([7, 1, 0, 12], [7, 30, 5, 40])):
        q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, 4, 2, 16, 4, torch.float32, seed=len(q_lens))
        got = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.3, window=window, softcap=softcap, chunk=chunk)
        want = dense_reference(q, kc, vc, bt, sl, cu, 0.3, window, softcap, chunk)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_window_wider_than_the_context_changes_nothing():
    q, kc, vc, bt, sl, cu = make_paged([5, 1], [20, 9], 4, 2, 16, 4, torch.float32, seed=3)
    plain = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.25)
    torch.testing.assert_close(pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.25, window=20), plain)
    assert not torch.allclose(pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.25, window=19), plain)


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,softcap,chunk", OPTIONS)
def test_decode_kernel(window, softcap, chunk, dtype, monkeypatch):
    """Contexts shorter than, equal to and longer than the window or chunk; small tiles so that
    a window or chunk starts inside a tile and several splits cover it."""
    if not GPU:
        monkeypatch.setitem(pa.DECODE_CONFIG, "block_n", 16)
    ctx = [3, 8, 21, 50] if not GPU else [100, 1024, 5000, 33]
    hq, hkv, d = (8, 2, 32) if not GPU else (16, 8, 256)
    q, kc, vc, bt, sl, cu = make_paged([1] * len(ctx), ctx, hq, hkv, d, 8 if not GPU else 16, dtype, seed=5)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, d**-0.5, window=window, softcap=softcap, chunk=chunk)
    for ns in ([1, 3] if not GPU else [None, 1, 8]):
        out = torch.full_like(q, float("nan"))
        pa.paged_attention_triton(q, kc, vc, bt, sl, cu, d**-0.5, 1, out=out, num_splits=ns, window=window,
                                  softcap=softcap, chunk=chunk)
        close(out, ref, dtype, f"decode window={window} softcap={softcap} chunk={chunk} splits={ns}")


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window,softcap,chunk", OPTIONS)
def test_prefill_kernel(window, softcap, chunk, dtype, monkeypatch):
    """A fresh prompt, a later chunk over a cached prefix, a decode token and an empty
    sequence in one batch; 16-row/16-key tiles so that the window's (or attention chunk's)
    skipped, masked-edge and unmasked tiles all occur."""
    if not GPU:
        monkeypatch.setitem(pa.PREFILL_CONFIG, 64, {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1})
        q_lens, ctx, (hq, hkv, d) = [40, 9, 1, 0], [40, 45, 30, 6], (4, 2, 64)
    else:
        q_lens, ctx, (hq, hkv, d) = [700, 256, 1, 0, 1024], [700, 5000, 513, 40, 1500], (16, 8, 256)
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, hq, hkv, d, 8 if not GPU else 16, dtype, seed=9)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, d**-0.5, window=window, softcap=softcap, chunk=chunk)
    out = torch.full_like(q, float("nan"))
    pa.paged_attention_triton(q, kc, vc, bt, sl, cu, d**-0.5, max(q_lens), out=out, window=window, softcap=softcap,
                              chunk=chunk)
    close(out, ref, dtype, f"prefill window={window} softcap={softcap} chunk={chunk}")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_kernel(dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(5, 2 * 300, generator=g)).to(dtype).to(DEV)
    ref = activation.gelu_tanh_and_mul_torch(x)
    close(activation.gelu_tanh_and_mul_triton(x), ref, dtype, "gelu_tanh_and_mul")
    i = x.shape[-1] // 2
    want = F.gelu(x[:, :i].double(), approximate="tanh") * x[:, i:].double()
    close(ref, want.to(dtype), dtype, "reference")
    torch.testing.assert_close(activation.act_and_mul(x, "gelu_tanh"), activation.gelu_tanh_and_mul(x))
    torch.testing.assert_close(activation.act_and_mul(x, "silu"), activation.silu_and_mul(x))


@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1, 1], [3, 11, 31, 47]), ([40, 9, 1, 0], [40, 47, 31, 6])])
def test_blocks_out_of_the_window_are_never_read(q_lens, ctx, monkeypatch):
    """What a window model's KV cache gives back (KVCacheManager.first_needed_block of each
    sequence's first new position), filled with NaN, its table entries pointing at the
    sequence's first held block as the runner writes them: the reference and the Triton
    kernels (decode, or prefill over chunks) give what they gave on the whole cache. Some first
    positions sit where one position more would give back a block that is still read."""
    from kvship.core.kv_cache_manager import KVCacheManager

    window, block_size = 8, 4
    kv = KVCacheManager(1, block_size, window=window)
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, 4, 2, 64, block_size, torch.float32, seed=11)
    want = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.125, window=window)
    table = bt.clone()
    for b, (n, c) in enumerate(zip(q_lens, ctx)):
        first = kv.first_needed_block(c - n)
        kc[bt[b, :first].long()] = vc[bt[b, :first].long()] = float("nan")
        table[b, :first] = table[b, -(-c // block_size):] = bt[b, first]  # the junk past the end too
    assert not torch.isfinite(kc).all()  # something was given back
    torch.testing.assert_close(pa.paged_attention_torch(q, kc, vc, table, sl, cu, 0.125, window=window), want,
                               rtol=0, atol=0)
    if HAS_TRITON:
        monkeypatch.setitem(pa.DECODE_CONFIG, "block_n", 16)
        monkeypatch.setitem(pa.PREFILL_CONFIG, 64, {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1})
        out = pa.paged_attention_triton(q, kc, vc, table, sl, cu, 0.125, max(q_lens), window=window)
        close(out, want, torch.float32, f"triton q_lens={q_lens}")
