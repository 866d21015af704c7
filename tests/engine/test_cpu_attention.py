"""The CPU attention path (layers/attention.py's paged_attention_cpu): each sequence attends over
its own blocks, equal to the padded torch reference, with memory linear in the context."""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import paged_attention as pa
from kvship.layers import attention as attn

pytestmark = pytest.mark.timeout(120)


def _case(q_lens, ctxs, hq=6, hkv=2, d=16, block=4, seed=0, scattered=True):
    g = torch.Generator().manual_seed(seed)
    blocks_per = [-(-c // block) for c in ctxs]
    total = sum(blocks_per) + 3
    # scattered blocks (gathered), or each sequence's blocks one run (viewed in place)
    perm = torch.randperm(total, generator=g) if scattered else torch.arange(3, total + 3)
    tables = torch.zeros(len(ctxs), max(blocks_per), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks_per):
        tables[b, :n] = perm[at : at + n]
        at += n
    k_cache = torch.randn(total + 3, block, hkv, d, generator=g)
    v_cache = torch.randn(total + 3, block, hkv, d, generator=g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(ctxs, dtype=torch.int32), cu


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 30.0), (7, 20.0)])
@pytest.mark.parametrize("q_lens,ctxs", [
    ([1, 1, 1], [3, 17, 9]),  # decodes of different lengths (one at a time)
    ([1, 1, 1, 5], [12, 17, 9, 20]),  # decodes of similar lengths (one padded call), then a prefill
    ([13, 1, 6], [13, 21, 30]),  # a whole prompt, a decode, a chunk after a cached prefix
])
@pytest.mark.parametrize("scattered", [True, False])
def test_cpu_attention_matches_reference(q_lens, ctxs, window, softcap, scattered, monkeypatch):
    monkeypatch.setattr(attn, "CPU_SCORE_ELEMENTS", 200)  # several query chunks per prefill
    q, kc, vc, tables, lens, cu = _case(q_lens, ctxs, scattered=scattered)
    scale = 0.3
    want = pa.paged_attention_torch(q, kc, vc, tables, lens, cu, scale, window=window, softcap=softcap)
    got = attn.paged_attention_cpu(q, kc, vc, tables, lens, cu, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_attention_latent_cache_as_both():
    """Latent attention passes one cache as keys and values."""
    q, kc, _, tables, lens, cu = _case([5, 1], [9, 6], hq=4, hkv=1)
    want = pa.paged_attention_torch(q, kc, kc, tables, lens, cu, 0.2)
    torch.testing.assert_close(attn.paged_attention_cpu(q, kc, kc, tables, lens, cu, 0.2), want)


def _largest_intermediate(fn) -> int:
    """Bytes of the largest tensor an operator allocated while ``fn`` ran (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(max(e.cpu_memory_usage, 0) for e in prof.events())


def test_cpu_attention_memory_linear_in_prompt():
    """A prefill chunk of 64 queries over a 4k context, and a 4k prompt at once: no allocation
    above a few times the sequence's own keys and values plus one query chunk's scores, where the padded reference's scores
    alone are [heads, 4k, 4k] (quadratic)."""
    hq, hkv, d, block, ctx = 9, 3, 64, 16, 4096
    kv_bytes = ctx * hkv * d * 4
    for q_len in (64, ctx):
        q, kc, vc, tables, lens, cu = _case([q_len], [ctx], hq, hkv, d, block)
        out = None

        def run():
            nonlocal out
            out = attn.paged_attention_cpu(q, kc, vc, tables, lens, cu, d**-0.5)
        largest = _largest_intermediate(run)
        # the sequence's keys and values (and a copy), plus one query chunk's scores
        assert largest <= 3 * kv_bytes + 4 * attn.CPU_SCORE_ELEMENTS, (q_len, largest, kv_bytes)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())
    # the same bound fails attention that holds a whole prompt's scores: the check can tell them apart
    q, k = torch.randn(hq, 2048, d), torch.randn(hq, 2048, d)
    whole = _largest_intermediate(lambda: torch.softmax(q @ k.transpose(-1, -2), dim=-1))
    assert whole > 3 * 2048 * hkv * d * 4 + 4 * attn.CPU_SCORE_ELEMENTS
