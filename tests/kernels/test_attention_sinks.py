"""Attention sinks (gpt-oss: a learned logit per query head in each softmax's denominator, with
no value): the torch reference against the definition in float64, the CPU path against the
reference, and the Triton kernels (decode with and without context splits, varlen prefill; in
the interpreter without a GPU) against the reference, alone and with a sliding window."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import paged_attention as pa
from kvship.kernels._triton import HAS_TRITON
from kvship.layers.attention import paged_attention_cpu
from test_kernels import DTYPES, GPU, close, make_paged

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
KERNEL_DTYPES = DTYPES[:1]
WINDOWS = [None, 8] if not GPU else [None, 128]


def sinks_for(hq: int, seed: int = 0) -> torch.Tensor:
    """Sinks that matter: around the scores' own size, some far above them."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(hq, generator=g)
    s[0] = 4.0
    return s


def dense_reference(q, kc, vc, bt, sl, cu, scale, sinks, window=None):
    """softmax over [scores, sink] with the sink's column dropped, by its definition, in float64."""
    out = torch.zeros_like(q, dtype=torch.float64)
    group = q.shape[1] // kc.shape[2]
    starts = cu.tolist()
    for b, ctx in enumerate(sl.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = pa.gather_kv(kc, bt[b], ctx).double().repeat_interleave(group, dim=1)
        v = pa.gather_kv(vc, bt[b], ctx).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * scale
        q_pos = torch.arange(ctx - (e - s), ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        weights = scores.masked_fill(~visible, float("-inf")).exp()
        denom = weights.sum(-1, keepdim=True) + sinks.double().exp()[:, None, None]
        out[s:e] = torch.einsum("hqk,khd->qhd", weights / denom, v)
    return out


@pytest.mark.parametrize("window", WINDOWS[:2])
def test_reference_and_cpu_path_are_the_definition(window):
    """Decodes (the batched path) and prefill chunks over cached prefixes; a sink changes the
    output (it is not ignored)."""
    sinks = sinks_for(4)
    for q_lens, ctx in (([1, 1, 1], [3, 9, 30]), ([7, 1, 0, 12], [7, 30, 5, 40])):
        q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, 4, 2, 16, 4, torch.float32, seed=len(q_lens))
        want = dense_reference(q, kc, vc, bt, sl, cu, 0.3, sinks, window)
        got = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.3, window=window, sinks=sinks)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        cpu = paged_attention_cpu(q, kc, vc, bt, sl, cu, 0.3, window=window, sinks=sinks)
        torch.testing.assert_close(cpu.double(), want, atol=1e-5, rtol=1e-5)
        plain = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.3, window=window)
        assert (plain - got).abs().max() > 1e-2


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_kernel(window, dtype, monkeypatch):
    """One split (the sink in the decode kernel) and several (in the reduce kernel)."""
    if not GPU:
        monkeypatch.setitem(pa.DECODE_CONFIG, "block_n", 16)
    ctx = [3, 8, 21, 50] if not GPU else [100, 1024, 5000, 33]
    hq, hkv, d = (8, 2, 32) if not GPU else (64, 8, 64)
    q, kc, vc, bt, sl, cu = make_paged([1] * len(ctx), ctx, hq, hkv, d, 8 if not GPU else 16, dtype, seed=5)
    sinks = sinks_for(hq, 1).to(q.device)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, d**-0.5, window=window, sinks=sinks)
    for ns in ([1, 3] if not GPU else [None, 1, 8]):
        out = torch.full_like(q, float("nan"))
        pa.paged_attention_triton(q, kc, vc, bt, sl, cu, d**-0.5, 1, out=out, num_splits=ns, window=window,
                                  sinks=sinks)
        close(out, ref, dtype, f"decode window={window} splits={ns}")


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_kernel(window, dtype, monkeypatch):
    """A fresh prompt, a chunk over a cached prefix, a decode token and an empty sequence in one
    batch (the decode row through the decode kernel)."""
    if not GPU:
        monkeypatch.setitem(pa.PREFILL_CONFIG, 64, {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1})
        monkeypatch.setitem(pa.DECODE_CONFIG, "block_n", 16)
        q_lens, ctx, (hq, hkv, d) = [1, 40, 9, 0], [30, 40, 45, 6], (4, 2, 64)
    else:
        q_lens, ctx, (hq, hkv, d) = [1, 700, 256, 0, 1024], [513, 700, 5000, 40, 1500], (64, 8, 64)
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, hq, hkv, d, 8 if not GPU else 16, dtype, seed=9)
    sinks = sinks_for(hq, 2).to(q.device)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, d**-0.5, window=window, sinks=sinks)
    out = torch.full_like(q, float("nan"))
    pa.paged_attention_triton(q, kc, vc, bt, sl, cu, d**-0.5, max(q_lens), out=out, window=window, sinks=sinks,
                              num_decodes=1)
    close(out, ref, dtype, f"prefill window={window}")
