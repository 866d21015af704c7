"""Triton kernels against their plain-torch references.

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on
tiny shapes in fp32 and fp16; with a GPU the same tests run in bf16 at real sizes (Llama-3-8B
and SmolLM2 head layouts) with bf16-range tolerances.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvship.kernels import activation, argmax, gemv, norm, rotary
from kvship.kernels import allreduce_norm as arn
from kvship.kernels import lora as lora_kernels
from kvship.kernels import paged_attention as pa
from kvship.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]


def tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def close(out, ref, dtype, what=""):
    """Relative-norm check plus an elementwise bound; NaN never passes."""
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    o, r = out.double(), ref.double()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-12)).item()
    assert rel < tol(dtype), f"{what}: rel err {rel:.3e}"
    atol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 6e-2}[dtype]
    err = (o - r).abs().max().item()
    assert err < atol + 2 * tol(dtype) * r.abs().max().item(), f"{what}: max err {err:.3e}"


def make_paged(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed, extra_cols=2):
    """Random paged cache with shuffled (non-contiguous) block tables, spare columns and
    spare blocks; q holds the new tokens of each sequence."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = [-(-c // block_size) for c in ctx_lens]
    total = sum(n_blocks) + 3
    perm = torch.randperm(total, generator=g)
    max_blocks = max(n_blocks) + extra_cols
    bt = torch.randint(0, total, (len(ctx_lens), max_blocks), generator=g, dtype=torch.int32)  # junk past the end
    i = 0
    for b, n in enumerate(n_blocks):
        bt[b, :n] = perm[i : i + n].to(torch.int32)
        i += n
    k_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return [t.to(DEV) for t in (q, k_cache, v_cache, bt, seq_lens, cu)]


HEADS = [(2, 2, 64), (9, 3, 64), (8, 2, 128)] if not GPU else [(32, 32, 128), (9, 3, 64), (32, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,d", HEADS)  # GQA groups 1, 3, 4
def test_decode(hq, hkv, d, block_size, dtype):
    if GPU:
        ctx = [1, 17, 1000, 4096, 2049, 513, 33, 3000]
    else:
        ctx = [1, 17, 100, 33]
    q, kc, vc, bt, sl, cu = make_paged([1] * len(ctx), ctx, hq, hkv, d, block_size, dtype, seed=hq + block_size)
    scale = d**-0.5
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, scale)
    # CPU: None resolves to splits > 1 here (4 "SMs"), so split-K and its reduce run
    splits = [None, 1] if not GPU else [None, 1, 8, 64]
    for ns in splits:
        out = torch.full_like(q, float("nan"))  # every element must be written
        got = pa.paged_attention_triton(q, kc, vc, bt, sl, cu, scale, 1, out=out, num_splits=ns)
        assert got is out
        close(out, ref, dtype, f"decode splits={ns}")


@pytest.mark.parametrize("block_n", [16, 32])
def test_decode_small_tiles_many_per_split(block_n, monkeypatch):
    """Several tiles per split, tiles smaller than / equal to a page, uneven split count."""
    dtype = DTYPES[0]
    monkeypatch.setitem(pa.DECODE_CONFIG, "block_n", block_n)
    ctx = [100, 37, 64] if not GPU else [5000, 37, 1024]
    q, kc, vc, bt, sl, cu = make_paged([1] * len(ctx), ctx, 8, 2, 64, 32, dtype, seed=block_n)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, 0.125)
    for ns in (3, 2):
        out = pa.paged_attention_triton(q, kc, vc, bt, sl, cu, 0.125, 1, num_splits=ns)
        close(out, ref, dtype, f"decode block_n={block_n} splits={ns}")


def test_decode_default_splits_active():
    """At small batch the default split count is > 1 (flash-decoding) and depends on shapes only."""
    assert pa.decode_num_splits(1, 8, 32768, 132, 64) > 1
    assert pa.decode_num_splits(128, 8, 32768, 132, 64) == 1
    assert pa.decode_num_splits(1, 8, 16, 132, 64) == 1  # never more splits than tiles


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_prefill_varlen_cached_prefix(hq, hkv, d, block_size, dtype):
    """Mixed batch: a fresh prompt, prefix-cache hits / later chunks (q_len < ctx), a decode
    token and an empty sequence."""
    if GPU:
        q_lens, ctx = [700, 256, 1, 0, 1024], [700, 2000, 513, 40, 1500]
    else:
        q_lens, ctx = [20, 7, 1, 0, 33], [20, 50, 17, 9, 40]
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, hq, hkv, d, block_size, dtype, seed=7 * hq + d)
    scale = d**-0.5
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, scale)
    out = pa.paged_attention_triton(q, kc, vc, bt, sl, cu, scale, max(q_lens))
    close(out, ref, dtype, "prefill")


class LaunchSpy:
    """Stands in for a Triton kernel object: records each launch's grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def mixed_step_lens():
    """A step's sequences, decodes first (Batch.decodes_first): three decodes at different
    contexts, then a fresh prompt, a later chunk of a prompt, a one-token prompt chunk after it
    is not (only the leading ones count) and an empty sequence."""
    if GPU:
        return [1, 1, 1, 700, 256, 1, 0], [513, 4000, 37, 700, 2000, 900, 40]
    return [1, 1, 1, 20, 7, 1, 0], [17, 45, 3, 20, 50, 30, 9]


def check_mixed_step(monkeypatch, q, kc, vc, bt, sl, cu, q_lens, scale, dtype, what, **scales):
    """The step through paged_attention_triton with num_decodes = 3: equal to the torch
    reference, and the decode kernel launched for exactly the three leading sequences."""
    spy = LaunchSpy(pa._decode_kernel)
    monkeypatch.setattr(pa, "_decode_kernel", spy)
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, scale, scales.get("k_scale"), scales.get("v_scale"))
    out = pa.paged_attention_triton(q, kc, vc, bt, sl, cu, scale, max(q_lens), num_decodes=3, **scales)
    close(out, ref, dtype, what)
    assert [g[0] for g in spy.grids] == [3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_mixed_step_decodes_through_the_decode_kernel(hq, hkv, d, dtype, monkeypatch):
    """A step that mixes prompt chunks with decodes (continuous batching admits a prompt as
    soon as a sequence ends): the leading decodes run through the decode kernel, the rest
    through the prefill kernel, into one output."""
    q_lens, ctx = mixed_step_lens()
    q, kc, vc, bt, sl, cu = make_paged(q_lens, ctx, hq, hkv, d, 16, dtype, seed=11 * hq + d)
    check_mixed_step(monkeypatch, q, kc, vc, bt, sl, cu, q_lens, d**-0.5, dtype, "mixed step")


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_matches_whole(dtype):
    """A prompt prefilled in chunks (each chunk attending to the cached earlier chunks) gives
    the same outputs as the reference over the whole prompt."""
    hq, hkv, d, bs = (8, 2, 64, 16) if not GPU else (32, 8, 128, 16)
    n, chunk = (45, 16) if not GPU else (3000, 1024)
    q, kc, vc, bt, sl, cu = make_paged([n], [n], hq, hkv, d, bs, dtype, seed=3)
    scale = d**-0.5
    ref = pa.paged_attention_torch(q, kc, vc, bt, sl, cu, scale)
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        cu_c = torch.tensor([0, e - s], dtype=torch.int32, device=DEV)
        sl_c = torch.tensor([e], dtype=torch.int32, device=DEV)
        outs.append(pa.paged_attention_triton(q[s:e], kc, vc, bt, sl_c, cu_c, scale, e - s))
    close(torch.cat(outs), ref, dtype, "chunked")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096] if GPU else [64, 576])
def test_rms_norm(hidden, dtype):
    t = 300 if GPU else 5
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEV)
    r = torch.randn(t, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    close(norm.rms_norm_triton(x, w, 1e-5), norm.rms_norm_torch(x, w, 1e-5), dtype, "rms")
    n_ref, r_ref = norm.fused_add_rms_norm_torch(x, r, w, 1e-6)
    n_got, r_got = norm.fused_add_rms_norm_triton(x, r, w, 1e-6)
    close(n_got, n_ref, dtype, "fused normed")
    close(r_got, r_ref, dtype, "fused residual")
    # 3-D input
    close(norm.rms_norm_triton(x.view(1, t, hidden), w, 1e-5), norm.rms_norm_torch(x, w, 1e-5).view(1, t, hidden), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype):
    """Gated DeltaNet's output norm: float32 head outputs, z a strided view of a wider projection."""
    t, h, d = (33, 48, 128) if GPU else (3, 4, 32)
    g = torch.Generator().manual_seed(7)
    o = torch.randn(t, h, d, generator=g).to(DEV)
    proj = torch.randn(t, 3 * h * d, generator=g).to(dtype).to(DEV)
    z = proj[:, h * d:2 * h * d]
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEV)
    ref = norm.gated_rms_norm_torch(o, z.reshape(t, h, d), w, 1e-6, dtype).reshape(t, h * d)
    close(norm.gated_rms_norm_triton(o, z, w, 1e-6, dtype), ref, dtype, "gated rms")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (3, 576)] if GPU else [(1, 64), (3, 40)])
def test_allreduce_add_rms_norm_two_ranks(rows, hidden, dtype):
    """Both ranks' kernels run one after the other on one device: rank 1's flag for rank 0 is
    raised by hand first (as if rank 1 had already arrived); after both calls every flag is back
    where it started, and both ranks hold the reference result, bit for bit the same."""
    g = torch.Generator().manual_seed(rows * hidden)
    parts = [torch.randn(rows, hidden, generator=g).to(dtype).to(DEV) for _ in range(2)]
    res = torch.randn(rows, hidden, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEV)
    bufs = [torch.full((rows * hidden + 5,), float("nan"), dtype=dtype, device=DEV) for _ in range(2)]
    flags = [torch.zeros(8, dtype=torch.int32, device=DEV) for _ in range(2)]
    bufs[0][: rows * hidden].copy_(parts[1].reshape(-1))  # rank 1 has stored its rows in rank 0's slot ...
    flags[0][:rows] = 1  # ... and signalled rank 0
    got = []
    for rank in (0, 1):
        peer = 1 - rank
        got.append(arn.allreduce_add_rms_norm_triton(parts[rank], res, w, 1e-5, bufs[rank], bufs[peer],
                                                     flags[peer], flags[rank]))
        if rank == 0:
            assert flags[1][:rows].tolist() == [1] * rows and flags[0].tolist() == [0] * 8
    assert flags[0][:rows].tolist() == [1] * rows and flags[1].tolist() == [0] * 8
    n_ref, r_ref = arn.allreduce_add_rms_norm_torch(parts, res, w, 1e-5)
    for n_got, r_got in got:
        close(n_got, n_ref, dtype, "normed")
        close(r_got, r_ref, dtype, "residual")
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    torch.testing.assert_close(got[0][1], r_ref, atol=0, rtol=0)  # the same roundings as NCCL + add


def store_inputs(t, num_slots, hq, hkv, d, dtype, g, gain=1.0):
    """Inputs of the fused rotary + KV store: cos/sin cache, positions, slots (a quarter -1,
    padding), and q, k, v as strided views of one fused qkv projection (returned too)."""
    cache = rotary.build_cos_sin_cache(4096, d).to(DEV)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEV)
    slots = torch.randperm(num_slots, generator=g)[:t].to(torch.int64)
    slots[torch.randperm(t, generator=g)[: t // 4]] = -1
    slots = slots.to(DEV)
    qkv = (gain * torch.randn(t, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEV)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return cache, pos, slots, qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def qk_norm_weights(d, dtype, g) -> rotary.QKNorm:
    """Per-head q/k norm weights near 1 in ``dtype`` (the model's, or float32 as Gemma 3 holds
    its folded 1 + w)."""
    w = 1.0 + 0.2 * torch.randn(2, d, generator=g)
    return rotary.QKNorm(w[0].to(dtype).to(DEV), w[1].to(dtype).to(DEV), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_dtype", [None, "model", torch.float32])
@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (4, 2, 128, 32)] if not GPU
                         else [(32, 8, 128, 16), (9, 3, 64, 32)])
def test_rotary_store_kv(hq, hkv, d, block_size, norm_dtype, dtype):
    """Fused (per-head q/k RMSNorm +) rotary + KV store = rms_norm_torch, rotary_torch then
    store_kv_torch, on strided q/k/v views of a fused qkv projection, with padding tokens (slot
    -1) that must leave the cache alone."""
    t, nb = (13, 4) if not GPU else (2048, 300)
    g = torch.Generator().manual_seed(d + block_size)
    cache, pos, slots, qkv, q, k, v = store_inputs(t, nb * block_size, hq, hkv, d, dtype, g, gain=3.0)
    qk_norm = None if norm_dtype is None else qk_norm_weights(d, dtype if norm_dtype == "model" else norm_dtype, g)
    kc = torch.randn(nb, block_size, hkv, d, generator=g).to(dtype).to(DEV)
    vc = torch.randn(nb, block_size, hkv, d, generator=g).to(dtype).to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_before = qkv[:, hq * d :].clone()
    q_ref = rotary.rotary_store_kv_torch(pos, q.clone(), k, v, cache, kc_ref, vc_ref, slots, qk_norm=qk_norm)
    q_got = rotary.rotary_store_kv_triton(pos, q, k, v, cache, kc, vc, slots, qk_norm=qk_norm)
    assert q_got.data_ptr() == q.data_ptr()  # rotated in place
    close(q_got, q_ref, dtype, "rotated q")
    close(kc, kc_ref, dtype, "k cache")
    assert torch.equal(vc, vc_ref)  # v copied bit for bit, padding slots untouched
    assert torch.equal(qkv[:, hq * d :], kv_before)  # k and v themselves unchanged


def test_rotary_reference_matches_hf_formula():
    """rotary_torch equals the HF rotate_half formulation q*cos + rotate_half(q)*sin."""
    t, h, d = 5, 2, 16
    cache = rotary.build_cos_sin_cache(64, d, dtype=torch.float64)
    pos = torch.tensor([0, 3, 9, 63, 1])
    q, k = torch.randn(t, h, d, dtype=torch.float64), torch.randn(t, 1, d, dtype=torch.float64)
    cos = torch.cat([cache[pos, : d // 2]] * 2, -1)[:, None].double()
    sin = torch.cat([cache[pos, d // 2 :]] * 2, -1)[:, None].double()

    def rotate_half(x):
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)

    qr, kr = rotary.rotary_torch(pos, q, k, cache)
    torch.testing.assert_close(qr, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(kr, k * cos + rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 14336] if GPU else [96, 1100])
def test_silu_and_mul(inter, dtype):
    t = 300 if GPU else 3
    g = torch.Generator().manual_seed(inter)
    x = (2 * torch.randn(t, 2 * inter, generator=g)).to(dtype).to(DEV)
    close(activation.silu_and_mul_triton(x), activation.silu_and_mul_torch(x), dtype, "silu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,bias", [(50, 200, False), (33, 64, True)] if not GPU
                         else [(6144, 4096, False), (4096, 14336, False), (1000, 3000, True)])
def test_gemv(n, k, bias, dtype):
    """One-row GEMV = F.linear (after each gated activation when given one), with rows and columns
    that do not fill the last block."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    h = (2 * torch.randn(1, 2 * k, generator=g)).to(dtype).to(DEV)  # a gate/up output
    for cfg in ({"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1},
                {"block_n": 8, "block_k": 128, "num_warps": 4, "num_stages": 3}):
        close(gemv.gemv_triton(x, w, b, cfg), gemv.gemv_torch(x, w, b), dtype, f"gemv {cfg}")
        for act in activation.ACTIVATIONS:
            close(gemv.gemv_triton(h, w, b, cfg, act=act), gemv.gemv_torch(h, w, b, act=act), dtype, act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("slot", [1, -1])
def test_gemv_takes_loras_shrink_in_the_same_launch(slot, act, dtype):
    """With an adapter's stacked A, the programs past W's rows give LoRA's shrink of the same x
    (float32, as lora_shrink's; zeros for a row without an adapter) and y stays the GEMV's; R
    rows that do not fill a block, after N rows that do not either."""
    n, k, r = 50, 200, 24
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 2 * k if act else k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV)
    a = (torch.randn(3, r, k, generator=g) / k**0.5).to(dtype).to(DEV)
    slots = torch.tensor([slot], dtype=torch.int32, device=DEV)
    cfg = {"block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 1}
    y, h = gemv.gemv_triton(x, w, b, cfg, act=act, lora=(a, slots))
    close(y, gemv.gemv_torch(x, w, b, act=act), dtype, "gemv with lora rows")
    assert h.shape == (1, 1, r) and h.dtype == torch.float32
    want = lora_kernels.lora_shrink_torch(x, a, slots, act)
    close(h, want, dtype, "shrink rows")
    if slot < 0:
        assert h.abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,nope,v,rank", [(3, 24, 20, 40), (2, 16, 16, 130)] if not GPU
                         else [(16, 128, 128, 512), (128, 128, 128, 512), (5, 64, 96, 320)])
def test_head_gemv_on_deepseeks_absorbed_blocks(heads, nope, v, rank, dtype):
    """Per-head one-token products = torch.bmm, both orientations, on the views DeepSeek's attention
    takes: W_UK [h, nope, rank] (rows of outputs) and W_UV [h, v, rank] (rows of inputs) sliced
    out of one [h, nope + v, rank] matrix, the query a slice of wider per-head rows; sizes that
    do not fill the last tile, and several K tiles."""
    g = torch.Generator().manual_seed(heads * rank)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).to(dtype).to(DEV)
    q = torch.randn(1, heads, nope + 8, generator=g).to(dtype).to(DEV)[:, :, :nope]  # q_nope beside q_pe
    o = torch.randn(1, heads, rank, generator=g).to(dtype).to(DEV)
    small = {"block_n": 16, "block_k": 32, "num_warps": 4}
    for cfg in (None, small):
        got = gemv.head_gemv_triton(q, w[:, :nope], True, cfg)
        assert got.shape == (1, heads, rank) and got.is_contiguous()
        close(got, gemv.head_matmul_torch(q, w[:, :nope], True), dtype, f"W_UK {cfg}")
        got = gemv.head_gemv_triton(o, w[:, nope:], False, cfg)
        assert got.shape == (1, heads, v)
        close(got, gemv.head_matmul_torch(o, w[:, nope:], False), dtype, f"W_UV {cfg}")
    want = torch.einsum("thk,hkn->thn", q.double(), w[:, :nope].double())  # the definition
    close(gemv.head_matmul_torch(q, w[:, :nope], True).double(), want, dtype, "reference")


def test_float_linear_reads_16_bit_rows_beside_float32_weights(monkeypatch):
    """DeepSeek's router: float32 logits of a 16-bit row times float32 weights, the GEMV's (one
    launch, in a captured graph) equal to F.linear on the converted row; eagerly F.linear."""
    g = torch.Generator().manual_seed(64)
    w = torch.randn(64, 2048 if GPU else 96, generator=g).to(DEV)
    x = torch.randn(1, w.shape[1], generator=g).to(DTYPES[-1]).to(DEV)
    want = torch.nn.functional.linear(x.float(), w)
    for cfg in (gemv.FLOAT_GEMV_CONFIG, {"block_n": 8, "block_k": 32, "num_warps": 4, "num_stages": 1}):
        got = gemv.gemv_triton(x, w, config=cfg, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    calls = []
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a, **kw: calls.append(kw["config"]) or want)
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    capturing = [False]
    monkeypatch.setattr(gemv.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    torch.testing.assert_close(gemv.float_linear(x, w), want)
    assert calls == []
    capturing[0] = True
    gemv.float_linear(x, w)
    gemv.float_linear(torch.cat([x, x]), w)  # two rows: F.linear
    assert calls == [gemv.FLOAT_GEMV_CONFIG]


def test_head_matmul_dispatch_only_for_one_token_in_graphs(monkeypatch):
    """head_matmul runs the kernel for one token while a CUDA graph is captured, bmm otherwise."""
    calls = []
    capturing = [False]
    monkeypatch.setattr(gemv, "head_gemv_triton",
                        lambda x, w, t: calls.append(t) or gemv.head_matmul_torch(x, w, t).contiguous())
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(gemv.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    w = torch.randn(2, 8, 6)
    x1, x3 = torch.randn(1, 2, 8), torch.randn(3, 2, 8)
    torch.testing.assert_close(gemv.head_matmul(x1, w, True), torch.einsum("thk,hkn->thn", x1, w))
    assert calls == []  # eager: bmm
    capturing[0] = True
    torch.testing.assert_close(gemv.head_matmul(x1, w, True), torch.einsum("thk,hkn->thn", x1, w))
    assert gemv.head_matmul(torch.randn(1, 2, 6), w, False).shape == (1, 2, 8)
    assert calls == [True, False]
    torch.testing.assert_close(gemv.head_matmul(x3, w, True), torch.einsum("thk,hkn->thn", x3, w))
    assert len(calls) == 2  # several tokens: bmm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,v", [(1, 9000), (3, 4096), (2, 100)] if not GPU else [(1, 128256), (256, 151936), (5, 49152)])
def test_argmax(b, v, dtype):
    """Parallel argmax = torch's, ties included: they go to the lowest index."""
    g = torch.Generator().manual_seed(v)
    x = torch.randn(b, v, generator=g).to(dtype)
    x[0, v // 3] = x[0, v - 1] = x[0, 5] = 100.0  # a three-way tie across chunks: index 5 wins
    if b > 1:
        x[1] = 0.0  # an all-equal row: index 0
    x = x.to(DEV)
    got = argmax.argmax_triton(x)
    assert got.dtype == torch.int64 and got.tolist() == argmax.argmax_torch(x).tolist()
    assert got[0].item() == 5


def test_linear_dispatch_only_on_listed_shapes_in_graphs(monkeypatch):
    """gemv.linear sends one-row inputs of listed weight shapes to the kernel while a CUDA graph
    is captured, nothing else."""
    calls = []
    capturing = [False]
    monkeypatch.setattr(gemv, "gemv_triton",
                        lambda x, w, b, cfg, act=None: calls.append(cfg) or gemv.gemv_torch(x, w, b, act))
    monkeypatch.setattr(gemv, "use_triton", lambda t: True)
    monkeypatch.setattr(gemv.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setitem(gemv.GEMV_SHAPES, (8, 16), {"block_n": 8})
    w = torch.randn(8, 16)
    x1 = torch.randn(1, 16)
    torch.testing.assert_close(gemv.linear(x1, w), x1 @ w.T)
    gemv.act_mul_linear(torch.randn(1, 32), w, "silu")
    assert calls == []  # eager: cuBLAS, whose launch costs the host less
    capturing[0] = True
    torch.testing.assert_close(gemv.linear(x1, w), x1 @ w.T)
    assert calls == [{"block_n": 8}]
    gemv.linear(torch.randn(3, 16), w)  # several rows: cuBLAS
    gemv.linear(torch.randn(1, 8), torch.randn(4, 8))  # unlisted shape: cuBLAS
    assert len(calls) == 1
    h = torch.randn(1, 32)
    torch.testing.assert_close(gemv.act_mul_linear(h, w, "silu"), activation.silu_and_mul_torch(h) @ w.T)
    torch.testing.assert_close(gemv.act_mul_linear(h, w, "gelu_tanh"), activation.gelu_tanh_and_mul_torch(h) @ w.T)
    assert len(calls) == 3
    gemv.act_mul_linear(torch.randn(2, 32), w, "silu")  # several rows: separate kernels
    assert len(calls) == 3


def _captured(fn):
    """(a CUDA graph of fn(), what the captured call returned): fn runs once on a side stream
    first, so that its kernels compile outside the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
def test_decode_cuda_graph_capture():
    """rotary + KV store and split-K decode captured in a CUDA graph, replayed on new inputs."""
    dtype, hq, hkv, d, bs = torch.bfloat16, 32, 8, 128, 16
    ctx = [100, 2000, 37, 4096]
    q, kc, vc, bt, sl, cu = make_paged([1] * 4, ctx, hq, hkv, d, bs, dtype, seed=11)
    k_new = torch.randn(4, hkv, d, device=DEV, dtype=dtype)
    v_new = torch.randn_like(k_new)
    slots = torch.full((4,), -1, dtype=torch.int64, device=DEV)
    positions = torch.zeros(4, dtype=torch.int64, device=DEV)
    cos_sin = rotary.build_cos_sin_cache(8192, d, device=DEV)
    q_in = torch.empty_like(q)  # rotated in place by each replay
    out = torch.empty_like(q)
    scale = d**-0.5

    def step():
        q_in.copy_(q)
        rotary.rotary_store_kv_triton(positions, q_in, k_new, v_new, cos_sin, kc, vc, slots)
        pa.paged_attention_triton(q_in, kc, vc, bt, sl, cu, scale, 1, out=out)

    graph, _ = _captured(step)
    for trial in range(2):
        new_ctx = torch.tensor([c - 7 * trial for c in ctx], dtype=torch.int32, device=DEV)
        sl.copy_(new_ctx)
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        pos = new_ctx.long() - 1
        positions.copy_(pos)
        slots.copy_(bt.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)
        graph.replay()
        torch.cuda.synchronize()
        q_rot, k_rot = rotary.rotary_torch(positions, q, k_new, cos_sin)
        flat = kc.view(-1, hkv, d)
        close(flat[slots], k_rot, dtype, f"stored keys {trial}")
        ref = pa.paged_attention_torch(q_rot, kc, vc, bt, sl, cu, scale)
        close(out, ref, dtype, f"graph replay {trial}")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl_on", [False, True])
def test_pdl_chain_in_a_cuda_graph(pdl_on, monkeypatch):
    """A decode step's chain of PDL-aware kernels (residual norm, one-row GEMV, the fp16-pair
    GEMV reading its first tile before its wait, activation, argmax) replayed from a CUDA graph,
    each kernel reading its predecessor's output: with programmatic dependent launch (on an
    sm_90 GPU) the results are the ones without it, bit for bit, every replay."""
    from kvship.kernels import _triton
    from kvship.kernels.quant_gemv import qgemv_pairs_triton
    from kvship.kernels.quant_linear import PAIRS_GEMV_CONFIGS, pack
    from kvship.quant.insitu import quantize_groups

    if pdl_on and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9")
    g = torch.Generator(device=DEV).manual_seed(7)
    x, res = (torch.randn(1, 4096, device=DEV, generator=g, dtype=torch.bfloat16) for _ in range(2))
    w_norm = torch.rand(4096, device=DEV, generator=g, dtype=torch.bfloat16) + 0.5
    w1 = torch.randn(4096, 4096, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02
    w2 = pack(quantize_groups(torch.randn(2 * 4096, 4096, generator=torch.Generator().manual_seed(8)) * 0.02, 4, 128),
              DEV)
    cfg1 = gemv.GEMV_SHAPES[(4096, 4096)]

    def chain():
        h, r = norm.fused_add_rms_norm_triton(x, res, w_norm, 1e-5)
        y = gemv.gemv_triton(h, w1, config=cfg1)
        z = qgemv_pairs_triton(y, w2.qweight, w2.scales, w2.biases, None, 4, 128, 4096, PAIRS_GEMV_CONFIGS[4])
        a = activation.act_and_mul(z, "silu")
        return r, y, z, a, argmax.argmax_triton(a.float())

    pdl = _triton.pdl
    monkeypatch.setattr(_triton, "pdl", lambda t: False)
    want = chain()
    monkeypatch.setattr(_triton, "pdl", pdl if pdl_on else (lambda t: False))
    assert _triton.pdl(x) == pdl_on
    graph, got = _captured(chain)
    for _ in range(3):
        for t in got:
            t.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_dispatch_cpu_uses_torch():
    """The dispatch functions take the torch path for CPU tensors."""
    x = torch.randn(3, 8)
    torch.testing.assert_close(activation.silu_and_mul(x), activation.silu_and_mul_torch(x))
    w = torch.ones(8)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_torch(x, w, 1e-6))


def test_engine_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from kvship.kernels import paged_attention as pa, norm, rotary, activation\n"
        "from kvship.kernels._triton import HAS_TRITON\n"
        "assert not HAS_TRITON\n"
        "x = torch.randn(2, 8)\n"
        "assert norm.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "assert activation.silu_and_mul(x).shape == (2, 4)\n"
        "q = torch.randn(1, 2, 4); kc = torch.randn(2, 16, 1, 4)\n"
        "o = pa.paged_attention(q, kc, kc, torch.tensor([[1]]), torch.tensor([5]), torch.tensor([0, 1]), 0.5, 1)\n"
        "assert o.shape == q.shape\n"
    )
    env = {k: v for k, v in __import__("os").environ.items()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
