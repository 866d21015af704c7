"""Multi-head latent attention's Triton kernels (kernels/mla_attention.py) against their torch
reference in the interpreter: the decode kernel over shuffled pages at DeepSeek-V2-Lite's row
width and a tiny one, split and not, head counts off the head block; the prefill kernel over
cached prefixes; a step mixing decodes with prompt chunks; the rotary + latent store (padding
slots skipped, FP8 pages stored and read). Then the kernels compile for sm_90, every cache dtype."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import gemv, rotary
from kvship.kernels import mla_attention as mla
from kvship.kernels._triton import HAS_TRITON
from sm90_compile import compile_in_child, ints
from test_kernels import DEV

pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="triton not installed"), pytest.mark.timeout(600)]


def _paged(lens: list[int], block_size: int, width: int, dtype, seed: int):
    """A cache holding every sequence's rows on shuffled blocks, and its tables and lengths."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    cache = torch.randn(num_blocks, block_size, 1, width, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    return cache.to(DEV), tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV), g


@pytest.mark.parametrize("heads,rank,rope,dtype,splits", [
    (16, 512, 64, torch.float32, 1),  # V2-Lite's row (576 wide) and heads
    (16, 512, 64, torch.float16, 4),  # 16-bit (the interpreter's bf16 dots are wrong: numpy has no bf16)
    (20, 32, 8, torch.float32, 3),  # two head blocks, the second part-filled; rope under 16 channels
    (5, 32, 16, torch.float32, None),  # fewer heads than a dot's 16 rows; splits from the shapes
])
def test_decode_kernel_matches_reference(heads, rank, rope, dtype, splits):
    lens = [1, 37, 70, 5]
    cache, tables, seq_lens, g = _paged(lens, 16, rank + rope, dtype, 0)
    q = torch.randn(len(lens), heads, rank + rope, generator=g).to(DEV, dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    scale = (rank + rope) ** -0.5
    want = mla.mla_attention_torch(q, cache, tables, seq_lens, cu, scale, rank)
    out = torch.empty(len(lens), heads, rank, dtype=dtype, device=DEV)
    got = mla.mla_decode_triton(q, cache, tables, seq_lens, cu, scale, rank, out, num_splits=splits)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _projected(tokens: int, heads: int, rank: int, rope: int, dtype, g, nope: int = 24):
    """q_lat, q_pe, latent and k_pe as strided views, the way DeepSeekV2Attention leaves them
    (q_pe beside q_nope in the query projection, k_pe beside the latent, q_lat transposed from
    the per-head bmm), and a cos/sin table with positions."""
    q = (torch.randn(tokens, heads, nope + rope, generator=g) * 2).to(DEV, dtype)
    kv = (torch.randn(tokens, rank + rope, generator=g) * 3).to(DEV, dtype)
    q_lat = torch.randn(heads, tokens, rank, generator=g).to(DEV, dtype).transpose(0, 1)
    cos_sin = rotary.build_cos_sin_cache(64, rope, device=DEV)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(DEV)
    return positions, q_lat, q[..., nope:], kv[:, :rank], kv[:, rank:], cos_sin


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_rope_store_matches_reference(cache_dtype):
    """The one-launch rotary + latent store against the torch reference on strided views: the
    query (two head blocks, the second part-filled) and the cache rows, padding slots (-1) writing
    nothing."""
    g = torch.Generator().manual_seed(4)
    heads, rank, rope, tokens = 20, 64, 16, 9
    dtype = torch.float16 if cache_dtype == torch.float16 else torch.float32
    positions, q_lat, q_pe, latent, k_pe, cos_sin = _projected(tokens, heads, rank, rope, dtype, g)
    slots = torch.randperm(6 * 8, generator=g)[:tokens].to(DEV)
    slots[[2, 7]] = -1
    scale = torch.tensor([0.05], device=DEV) if cache_dtype.itemsize == 1 else None
    got_cache, want_cache = (torch.zeros(6, 8, 1, rank + rope, dtype=cache_dtype, device=DEV) for _ in range(2))
    got = mla.rope_store_latent_triton(positions, q_lat, q_pe, latent, k_pe, cos_sin, got_cache, slots, scale)
    want = mla.rope_store_latent_torch(positions, q_lat, q_pe, latent, k_pe, cos_sin, want_cache, slots, scale)
    # bit for bit in the interpreter; a GPU compile may fuse the rotation's multiply-adds (one fp32 rounding
    # fewer), which can move a rounded value by a step of its format
    step = {torch.float32: 1e-6, torch.float16: 1e-3, torch.float8_e4m3fn: 0.125, torch.float8_e5m2: 0.25}
    exact = 0 if DEV == "cpu" else 1
    torch.testing.assert_close(got[..., :rank], want[..., :rank], atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=exact * 1e-6, rtol=exact * step[dtype])
    assert torch.equal(got_cache[..., :rank].float(), want_cache[..., :rank].float())
    torch.testing.assert_close(got_cache.float(), want_cache.float(), atol=exact * 1e-6, rtol=exact * step[cache_dtype])
    assert int((got_cache.view(-1, rank + rope).float().abs().sum(1) > 0).sum()) == tokens - 2


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_reads_fp8_pages(fp8, dtype):
    """An FP8 latent cache (one scale for the layer): rows stored by the Triton store, the
    kernel's output as the reference's over the same pages, split and not."""
    rank, rope, heads, lens = 64, 16, 16, [1, 40, 97]
    full, tables, seq_lens, g = _paged(lens, 16, rank + rope, torch.float32, 2)
    scale = torch.tensor([0.05], device=DEV)
    slots = torch.randperm(full.shape[0] * 16, generator=g)[:60].to(DEV)
    positions, q_lat, q_pe, latent, k_pe, cos_sin = _projected(60, heads, rank, rope, torch.float32, g)
    cache = torch.zeros(full.shape, dtype=fp8, device=DEV)
    mla.rope_store_latent_triton(positions, q_lat, q_pe, latent, k_pe, cos_sin, cache, slots, scale)
    rows = mla.rope_latent_torch(positions, q_lat, q_pe, latent, k_pe, cos_sin)[1]
    assert (cache.view(-1, rank + rope)[slots].float() * scale - rows).abs().max() < 0.2 * rows.abs().max()
    q = torch.randn(len(lens), heads, rank + rope, generator=g).to(DEV, dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEV)
    want = mla.mla_attention_torch(q, cache, tables, seq_lens, cu, 0.1, rank, scale)
    for splits in (1, 4):
        out = torch.empty(len(lens), heads, rank, dtype=dtype, device=DEV)
        got = mla.mla_decode_triton(q, cache, tables, seq_lens, cu, 0.1, rank, out, scale, num_splits=splits)
        tol = 2e-3 if dtype == torch.float16 else 1e-5
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_prefill_kernel_matches_reference(cache_dtype):
    """Prompt chunks over cached prefixes, one longer than a row block (45 new tokens after 30),
    one whole prompt, one of a single token: every row as the reference's, causal."""
    rank, rope, heads = 64, 16, 3
    lens, new = [75, 20, 9], [45, 20, 1]
    full, tables, seq_lens, g = _paged(lens, 8, rank + rope, torch.float32, 3)
    scale = torch.tensor([0.02], device=DEV)
    cache = full if cache_dtype == torch.float32 else (full / scale).to(cache_dtype)
    q = torch.randn(sum(new), heads, rank + rope, generator=g).to(DEV)
    cu = torch.tensor([0, 45, 65, 66], dtype=torch.int32, device=DEV)
    kv_scale = None if cache_dtype == torch.float32 else scale
    want = mla.mla_attention_torch(q, cache, tables, seq_lens, cu, 0.1, rank, kv_scale)
    out = torch.empty(sum(new), heads, rank, device=DEV)
    got = mla.mla_prefill_triton(q, cache, tables, seq_lens, cu, 0.1, rank, max(new), out, kv_scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mixed_step_decodes_and_chunks():
    """Two decodes first, then two prompt chunks over a cached prefix: every row as the reference."""
    rank, rope, heads, bs = 32, 8, 4, 4
    lens = [9, 30, 12, 21]
    new = [1, 1, 5, 12]
    cache, tables, seq_lens, g = _paged(lens, bs, rank + rope, torch.float32, 1)
    q = torch.randn(sum(new), heads, rank + rope, generator=g).to(DEV)
    cu = torch.tensor([0, 1, 2, 7, 19], dtype=torch.int32, device=DEV)
    want = mla.mla_attention_torch(q, cache, tables, seq_lens, cu, 0.3, rank)
    got = mla.mla_attention_triton(q, cache, tables, seq_lens, cu, 0.3, rank, max(new), num_decodes=2, num_splits=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(900)
def test_mla_kernels_compile_for_sm90():
    module = "kvship.kernels.mla_attention"
    specs = []
    for dtype in ("bf16", "fp32"):  # serving; --dtype float32
        types = {"q_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", "bt_ptr": "*i32", "seqlens_ptr": "*i32",
                 "cuq_ptr": "*i32", "out_ptr": f"*{dtype}", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
                 "qk_scale": "fp32",
                 **ints("stride_qt", "stride_qh", "stride_cb", "stride_cs", "stride_bt", "stride_ot", "stride_oh",
                        "stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh")}
        cfg = mla.MLA_DECODE_CONFIG
        for splits, fp8 in ((1, 0), (8, 0), (8, 1), (8, 2)):
            cache = {0: dtype, 1: "fp8e4nv", 2: "fp8e5"}[fp8]
            specs.append({"kernel": f"{module}:_mla_decode_kernel",
                          "types": types | {"c_ptr": f"*{cache}", "scale_ptr": "*fp32"},
                          "constexprs": {"NUM_HEADS": 16, "RANK": 512, "ROPE": 64, "BLOCK_R": 512, "BLOCK_P": 64,
                                         "BLOCK_H": cfg["block_h"], "BLOCK_SIZE": 16, "BLOCK_N": cfg["block_n"],
                                         "NUM_SPLITS": splits, "FP8": fp8, "PDL": True},
                          "divisible": ["q_ptr", "c_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_cb",
                                        "stride_cs"],
                          "options": {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}})
            if splits > 1:  # the prefill kernel, once per cache dtype
                pre = mla.MLA_PREFILL_CONFIG
                specs.append({"kernel": f"{module}:_mla_prefill_kernel",
                              "types": {k: v for k, v in types.items() if not k.startswith(("mid", "stride_m"))}
                              | {"c_ptr": f"*{cache}", "scale_ptr": "*fp32"},
                              "constexprs": {"RANK": 512, "ROPE": 64, "BLOCK_R": 512, "BLOCK_P": 64, "BLOCK_SIZE": 16,
                                             "BLOCK_M": pre["block_m"], "BLOCK_N": pre["block_n"], "FP8": fp8},
                              "divisible": ["q_ptr", "c_ptr", "out_ptr", "stride_qt", "stride_qh", "stride_cb",
                                            "stride_cs"],
                              "options": {"num_warps": pre["num_warps"], "num_stages": pre["num_stages"]}})
        for fp8, cache in ((0, dtype), (1, "fp8e4nv"), (2, "fp8e5")):
            specs.append({"kernel": f"{module}:_rope_store_latent_kernel",
                          "types": {"pos_ptr": "*i64", "cs_ptr": "*fp32", "qlat_ptr": f"*{dtype}", "qpe_ptr": f"*{dtype}",
                                    "lat_ptr": f"*{dtype}", "kpe_ptr": f"*{dtype}", "q_ptr": f"*{dtype}",
                                    "cache_ptr": f"*{cache}", "slots_ptr": "*i64", "scale_ptr": "*fp32",
                                    **ints("stride_cs", "stride_qlt", "stride_qlh", "stride_qpt", "stride_qph",
                                           "stride_lt", "stride_kt", "stride_qt", "stride_qh", "stride_c")},
                          "constexprs": {"NUM_HEADS": 16, "RANK": 512, "HALF": 32, "BLOCK_R": 512, "BLOCK_HALF": 32,
                                         "BLOCK_H": 16, "FP8": fp8, "PDL": True}})
        for transposed, cfg in gemv.HEAD_GEMV_CONFIG.items():  # the absorbed products (models/deepseek_v2.py)
            specs.append({"kernel": "kvship.kernels.gemv:_head_gemv_kernel",
                          "types": {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}",
                                    **ints("N", "K", "stride_xh", "stride_wh", "stride_wr", "stride_yh")},
                          "constexprs": {"TRANS": transposed, "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
                                         "PDL": True},
                          "divisible": ["x_ptr", "w_ptr", "y_ptr", "stride_xh", "stride_wh", "stride_wr", "stride_yh"],
                          "options": {"num_warps": cfg["num_warps"]}})
    compile_in_child(specs)
