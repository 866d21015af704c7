"""The fused mixture-of-experts kernels against the plain-torch definition.

Without a GPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1) on
tiny fp32 shapes; with one, at Qwen3-30B-A3B's sizes in bf16, and inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from kvship.kernels import fused_moe as fm
from kvship.kernels._triton import HAS_TRITON
from kvship.layers.moe import MoEExperts, moe_reference, route
from kvship.parallel import TPContext
from kvship.quant import QuantizedTensor, QuantRef, QuantScheme, checkpoint_format, quantize
from kvship.quant.insitu import quantize_groups

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"  # the tiny fp32 cases run on the GPU too, outside the interpreter


def _check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """The kernel's alignment has the invariants below and equals the torch ops' exactly."""
    ids = ids.to(DEV)
    aligned = fm.align_by_expert_triton(ids, num_experts, block_m)
    for got, want in zip(aligned, fm.align_by_expert_torch(ids, num_experts, block_m)):
        assert torch.equal(got, want)
    sorted_pairs, block_experts, num_padded = aligned
    flat = ids.flatten().cpu()
    pairs = flat.numel()
    sorted_pairs, block_experts, used = sorted_pairs.cpu().long(), block_experts.cpu().long(), int(num_padded)
    # shapes depend on (T, k, E, block_m) only: the worst case of one padded list per pair's expert
    blocks = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    assert sorted_pairs.shape == (blocks * block_m,) and block_experts.shape == (blocks,)
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int((-(-counts // block_m) * block_m).sum()) and used % block_m == 0
    live = sorted_pairs[:used]
    assert sorted(live[live < pairs].tolist()) == list(range(pairs))  # every pair once
    assert (sorted_pairs[used:] == pairs).all() and (block_experts[used // block_m:] == -1).all()
    for b in range(used // block_m):
        rows = live[b * block_m:(b + 1) * block_m]
        real = rows[rows < pairs]
        assert real.numel() > 0, "a block with no pair"
        assert (flat[real] == block_experts[b]).all()
        assert (real.diff() > 0).all()  # pair order kept within an expert
        assert (rows[:real.numel()] == real).all()  # padding only at a list's end
    assert block_experts[:used // block_m].diff().ge(0).all()


@pytest.mark.parametrize("block_m", [16, 64])
def test_alignment_invariants(block_m):
    g = torch.Generator().manual_seed(block_m)
    for tokens, top_k, num_experts in ((1, 1, 8), (1, 8, 128), (3, 2, 8), (17, 8, 10), (200, 8, 16)):
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
        _check_alignment(ids, num_experts, block_m)
    # everything on one expert, and experts with no tokens
    _check_alignment(torch.full((40, 1), 3), 8, block_m)
    # the worst case for padding: every pair its own expert
    _check_alignment(torch.arange(32).view(4, 8), 32, block_m)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_kernel(renormalize):
    g = torch.Generator().manual_seed(int(renormalize))
    for tokens, num_experts, top_k in ((1, 8, 2), (5, 10, 8), (3, 60, 1), (4, 128, 8)):
        logits = torch.randn(tokens, num_experts, generator=g).to(DEV)
        weights, ids = fm.route_triton(logits, top_k, renormalize)
        want_w, want_ids = fm.route_torch(logits, top_k, renormalize)
        assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n_group,topk_group,num_experts,top_k,renormalize", [
    (1, 1, 64, 6, True),  # Moonlight-16B-A3B
    (8, 4, 256, 8, True),  # DeepSeek-V3
    (4, 2, 16, 3, False),
    (2, 1, 4, 1, True),  # groups of two: the second best is the other one
])
def test_noaux_route_kernel(n_group, topk_group, num_experts, top_k, renormalize):
    """DeepSeek-V3's routing in one kernel against its torch reference: the same experts in the
    same order, the same weights; biased choices so that the bias (left out of the weights) and
    the group limit both decide some of them."""
    g = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(9, num_experts, generator=g).to(DEV)
    bias = (torch.randn(num_experts, generator=g) * 0.5).to(DEV)
    weights, ids = fm.noaux_route_triton(logits, bias, top_k, n_group, topk_group, renormalize)
    want_w, want_ids = fm.noaux_route_torch(logits, bias, top_k, n_group, topk_group, renormalize)
    assert ids.dtype == want_ids.dtype and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    scaled, scaled_ids = fm.noaux_route_triton(logits, bias, top_k, n_group, topk_group, renormalize, 2.446)
    assert torch.equal(scaled_ids, want_ids)  # routed_scaling_factor scales the weights, chooses nothing
    torch.testing.assert_close(scaled, want_w * 2.446, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fm.noaux_route_torch(logits, bias, top_k, n_group, topk_group, renormalize, 2.446)[0],
                               want_w * 2.446)
    if n_group > 1:  # the group limit changed some choice against a plain top-k of score plus bias
        plain = (torch.sigmoid(logits) + bias).topk(top_k, dim=-1).indices
        assert not torch.equal(plain, want_ids)


def _problem(tokens, top_k, num_experts, hidden, inter, seed, dead, dtype=torch.float32, device=DEV):
    """x, router, w13, w2 with expert `dead` never chosen: x's first feature is 1 and only the
    dead expert's router row weighs it, with a large negative weight. Its weights are NaN, so a
    kernel that reads an expert no token chose fails the comparison. Drawn on ``device``: drawn on
    the host, a real size's weights took most of each GPU test's time."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device)
    x[:, 0] = 1.0
    router = torch.randn(num_experts, hidden, generator=g, device=device)
    router[:, 0] = 0.0
    router[dead, 0] = -1e3
    # weights scaled so that h and the output stay O(1): bf16 rounding is then relative
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5
    w13[dead], w2[dead] = float("nan"), float("nan")
    return [t.to(dtype) for t in (x, router, w13, w2)]


def _close(out, ref, rel_tol):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < rel_tol, f"rel err {rel:.3e}"


@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_moe_matches_reference(tokens, top_k):
    num_experts, dead = 10, 4
    x, router, w13, w2 = _problem(tokens, top_k, num_experts, 32, 16, seed=tokens * top_k, dead=dead)
    renorm = top_k == 8  # Qwen3-MoE renormalizes; Qwen2-MoE does not
    weights, ids = route(x @ router.T, top_k, renorm)
    assert not (ids == dead).any()
    want = moe_reference(x, router, w13, w2, top_k, renorm)
    grouped = fm.fused_moe_triton(x, w13, w2, weights, ids, config=fm.moe_config(tokens, top_k, num_experts))
    torch.testing.assert_close(grouped, want, atol=1e-4, rtol=1e-4)
    # the few-token kernels at any token count (the dispatch sends them only a few)
    torch.testing.assert_close(fm.fused_moe_gemv(x, w13, w2, weights, ids), want, atol=1e-4, rtol=1e-4)
    # a shared expert's output added in the down kernel, on every path
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(tokens)).to(x.device)
    for got in (fm.fused_moe_gemv(x, w13, w2, weights, ids, add=shared),
                fm.fused_moe_triton(x, w13, w2, weights, ids, config=fm.moe_config(tokens, top_k, num_experts),
                                    add=shared),
                fm.fused_moe_triton(x, w13, w2, weights, ids, add=shared),
                fm.fused_moe_torch(x, w13, w2, weights, ids, add=shared)):
        torch.testing.assert_close(got, want + shared, atol=1e-4, rtol=1e-4)


def test_few_tokens_take_the_gemv_kernels(monkeypatch):
    """fused_moe_triton hands one token to fused_moe_gemv, more to the grouped GEMMs."""
    calls = []
    gemv = fm.fused_moe_gemv
    monkeypatch.setattr(fm, "fused_moe_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or gemv(*a, **kw))
    for tokens in (1, 2, 3):
        x, router, w13, w2 = _problem(tokens, 2, 8, 32, 16, seed=tokens, dead=0)
        weights, ids = route(x @ router.T, 2, False)
        torch.testing.assert_close(fm.fused_moe_triton(x, w13, w2, weights, ids),
                                   moe_reference(x, router, w13, w2, 2, False), atol=1e-4, rtol=1e-4)
    assert calls == [1]


def test_few_token_kernels_tiles():
    """Tiles smaller than the shapes: several K steps, N blocks and ragged edges (hidden 40,
    intermediate 24), bf16 weights rounded as the grouped path rounds them."""
    x, router, w13, w2 = _problem(3, 3, 8, 40, 24, seed=6, dead=0)
    weights, ids = route(x @ router.T, 3, True)
    tile = {"block_n": 4, "block_k": 16, "num_warps": 1, "num_stages": 1}
    got = fm.fused_moe_gemv(x, w13, w2, weights, ids, gate_up=tile, down=tile)
    torch.testing.assert_close(got, moe_reference(x, router, w13, w2, 3, True), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [fm.MoEConfig(32, 32, 16, 4, 2), fm.MoEConfig(64, 16, 32, 4, 2)])
def test_fused_moe_tiles(cfg):
    """Other tiles than moe_config picks for tiny shapes: several K steps, N tiles and ragged
    edges (hidden 40, intermediate 24)."""
    x, router, w13, w2 = _problem(9, 3, 8, 40, 24, seed=5, dead=0)
    weights, ids = route(x @ router.T, 3, False)
    got = fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg)
    torch.testing.assert_close(got, moe_reference(x, router, w13, w2, 3, False), atol=1e-4, rtol=1e-4)


def test_fused_moe_tensor_parallel_shards_sum_to_the_whole():
    """Each rank holds its slice of every expert's intermediate dimension (gate and up rows, w2
    columns) and returns partial sums: over the ranks they add up to the unsharded result."""
    x, router, w13, w2 = _problem(5, 2, 8, 32, 32, seed=3, dead=1)
    weights, ids = route(x @ router.T, 2, True)
    gate, up = w13.chunk(2, dim=1)
    parts = [fm.fused_moe_triton(x, torch.cat([g, u], dim=1).contiguous(), w2[:, :, r * 16:(r + 1) * 16].contiguous(),
                                 weights, ids)
             for r, (g, u) in enumerate(zip(gate.chunk(2, dim=1), up.chunk(2, dim=1)))]
    torch.testing.assert_close(parts[0] + parts[1], fm.fused_moe_torch(x, w13, w2, weights, ids), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.skipif(GPU, reason="CPU only: the Triton kernels run on CPU tensors in the interpreter")
def test_moe_model_on_the_fused_path_matches_transformers(tiny_models, monkeypatch):
    """The whole Qwen3-MoE model with its experts on the Triton kernels (the GPU's dispatch,
    forced here): greedy tokens equal transformers', batched, chunked and with a prefix hit."""
    from test_models import test_greedy_matches_transformers_batched_chunked_and_cached as compare

    calls = []
    triton_path = fm.fused_moe_triton
    monkeypatch.setattr(fm, "use_triton", lambda t: True)
    monkeypatch.setattr(fm, "fused_moe_triton", lambda *a, **kw: calls.append(1) or triton_path(*a, **kw))
    compare(tiny_models, "qwen3-moe")
    assert calls


def fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix [N, K] as a block-wise FP8 checkpoint stores it (Qwen3-30B-A3B-FP8, DeepSeek-V3):
    E4M3 codes and weight_scale_inv [ceil(N/b), ceil(K/b)], each block's amax / 448."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    scale = padded.view(nb, block, kb, block).abs().amax((1, 3)) / 448.0
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def _fp8(block: int | None):
    """A matrix [N, K] -> its FP8 QuantizedTensor: through the loader's own conversion of a
    block-wise checkpoint (``block`` x ``block``), or in-situ fp8 (one scale per row)."""
    if block is None:
        return lambda m: quantize(m, "fp8")
    fmt = checkpoint_format({"quant_method": "fp8", "weight_block_size": [block, block]})
    return lambda m: fmt.convert(dict(zip(("weight", "weight_scale_inv"), fp8_block(m, block))))


def _integer(bits: int, group: int | None, symmetric: bool):
    """A matrix [N, K] -> integer codes in groups of ``group`` inputs (None: one group a row):
    asymmetric min/max codes with offsets (k-quants, in-situ int4), or symmetric ones centred
    on 2**(bits - 1) with scale amax / (2**(bits - 1) - 1) (Q8_0, Q4_0, in-situ int8)."""
    def convert(m: torch.Tensor) -> QuantizedTensor:
        g = group or m.shape[1]
        if not symmetric:
            return quantize_groups(m, bits, g)
        n, k = m.shape
        blocks = m.float().view(n, k // g, g)
        scale = (blocks.abs().amax(2) / ((1 << (bits - 1)) - 1)).clamp_min(1e-12)
        codes = torch.round(blocks / scale[..., None]) + (1 << (bits - 1))
        return QuantizedTensor(codes.clamp(0, (1 << bits) - 1).to(torch.uint8).view(n, k), scale, None, bits, g)
    return convert


def _quantized_experts(w13: torch.Tensor, w2: torch.Tensor, convert, device=DEV
                       ) -> tuple[torch.Tensor, torch.Tensor, fm.ExpertScales]:
    """Stacked experts [E, 2I, H] and [E, H, I] as MoEExperts holds them once every matrix went
    through ``convert`` ([N, K] -> QuantizedTensor) and its weight_loader: (w13's codes, w2's,
    their ExpertScales), on ``device``."""
    num_experts, inter, hidden = w13.shape[0], w2.shape[2], w2.shape[1]
    with torch.device(device):
        experts = MoEExperts(num_experts, hidden, inter, TPContext(), quant=QuantScheme(checkpoint="test"))
    for e in range(num_experts):
        for part, m in ((0, w13[e, :inter]), (1, w13[e, inter:]), (None, w2[e])):
            param = experts.w2 if part is None else experts.w13
            experts.weight_loader(param, QuantRef(lambda m=m: convert(m.to(device)), "test"), (e, part))
    return experts.w13.data, experts.w2.data, experts.scales()


def _dequantized(c13: torch.Tensor, c2: torch.Tensor, scales: fm.ExpertScales) -> list[torch.Tensor]:
    """The stacks' weights in fp32, by the reference's dequantization."""
    inter, hidden = c13.shape[1] // 2, c2.shape[1]
    return [torch.stack([fm.expert_weight(c, scales, name, e, k, torch.float32) for e in range(c.shape[0])])
            for c, name, k in ((c13, "w13", hidden), (c2, "w2", inter))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", [None, 16])
def test_fp8_experts_match_the_reference_on_dequantized_weights(block):
    """FP8 codes with scales per row (in-situ fp8, per-channel checkpoints) or per 16 x 16 block
    (3 ragged blocks along hidden 40, 2 along intermediate 24): the grouped GEMMs (two tilings)
    and the one-token kernels (K tiles of one block and of several) equal fp32 torch on the
    dequantized weights, and so does the reference's own dequantization."""
    x, router, w13, w2 = _problem(9, 3, 8, 40, 24, seed=8, dead=0)
    weights, ids = route(x @ router.T, 3, True)
    c13, c2, scales = _quantized_experts(w13, w2, _fp8(block))
    assert c13.dtype == torch.float8_e4m3fn and (scales.w13_group, scales.w2_group) == ((16, 16) if block else (0, 0))
    deq13, deq2 = _dequantized(c13, c2, scales)
    assert (deq13 - w13)[1:].abs().max() < 0.1 * w13[1:].abs().max()  # FP8's 3 mantissa bits (expert 0: NaN)
    want = fm.fused_moe_torch(x, deq13, deq2, weights, ids)
    close = dict(atol=1e-5, rtol=1e-5)  # fp32, only the summation order differs
    torch.testing.assert_close(fm.fused_moe_torch(x, c13, c2, weights, ids, scales), want, atol=0, rtol=0)
    for cfg in (fm.moe_config(9, 3, 8), fm.MoEConfig(32, 32, 32, 4, 2)):
        torch.testing.assert_close(fm.fused_moe_triton(x, c13, c2, weights, ids, config=cfg, scales=scales), want,
                                   **close)
    tile = {"block_n": 4, "block_k": 16, "num_warps": 1, "num_stages": 1}
    for gate_up, down in ((None, None), (tile, tile)):
        torch.testing.assert_close(fm.fused_moe_gemv(x, c13, c2, weights, ids, gate_up, down, scales), want, **close)


INTEGER = [pytest.param(bits, group, symmetric, id=f"{bits}bit-{'g' + str(group) if group else 'row'}-"
                                                    f"{'symmetric' if symmetric else 'offsets'}")
           for bits in (4, 8) for group in (32, None) for symmetric in (True, False)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bits, group, symmetric", INTEGER)
def test_integer_experts_match_the_reference_on_dequantized_weights(bits, group, symmetric):
    """Integer codes (two a byte for 4 bits), symmetric or with offsets, in groups of 32 (hidden
    64, intermediate 32: 2 and 1 groups a row) or one group a row (hidden 40, intermediate 24:
    ragged against every tile), top 2 of 8 experts: one token on the one-token kernels (the
    dispatch's, and tiles of a few columns) and 9 on the grouped GEMMs (two tilings) equal fp32
    torch on the dequantized weights."""
    hidden, inter = (64, 32) if group else (40, 24)
    x, router, w13, w2 = _problem(9, 2, 8, hidden, inter, seed=bits + 2 * bool(group) + symmetric, dead=0)
    weights, ids = route(x @ router.T, 2, True)
    c13, c2, scales = _quantized_experts(w13, w2, _integer(bits, group, symmetric))
    assert c13.dtype == torch.uint8 and c13.shape == (8, 2 * inter, hidden * bits // 8)
    assert (scales.w13_bits, scales.w13_group, scales.w13_bias is None) == (bits, group or 0, symmetric)
    deq13, deq2 = _dequantized(c13, c2, scales)
    assert (deq13 - w13)[1:].abs().max() < (0.2 if bits == 4 else 0.02) * w13[1:].abs().max()  # (expert 0: NaN)
    want = fm.fused_moe_torch(x, deq13, deq2, weights, ids)
    torch.testing.assert_close(fm.fused_moe_torch(x, c13, c2, weights, ids, scales), want, atol=0, rtol=0)
    close = dict(atol=1e-5, rtol=1e-5)  # fp32, only the summation order differs
    torch.testing.assert_close(fm.fused_moe_triton(x[:1], c13, c2, weights[:1], ids[:1], scales=scales), want[:1],
                               **close)
    tile = {"block_n": 4, "block_k": 16, "num_warps": 1, "num_stages": 1}
    torch.testing.assert_close(fm.fused_moe_gemv(x[1:2], c13, c2, weights[1:2], ids[1:2], tile, tile, scales),
                               want[1:2], **close)
    for cfg in (fm.moe_config(9, 2, 8), fm.MoEConfig(32, 32, 32, 4, 2)):
        torch.testing.assert_close(fm.fused_moe_triton(x, c13, c2, weights, ids, config=cfg, scales=scales), want,
                                   **close)


def test_experts_stored_differently_are_widened_or_refused():
    """A layer's later experts in a coarser storage (Q4_K beside a Q6_K-like stack: 4 bits in
    groups of 32 with offsets, into 8 bits in groups of 16) are widened without changing their
    values; a finer one than the stack is refused, as act-order and odd groups are."""
    w = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))  # w2 [H 32, I 64]
    experts = MoEExperts(4, 32, 64, TPContext(), quant=QuantScheme(checkpoint="test"))
    fine, coarse = _integer(8, 16, False)(w[0]), _integer(4, 32, False)(w[1])
    for e, qt in enumerate((fine, coarse)):
        experts.weight_loader(experts.w2, QuantRef(lambda qt=qt: qt, "test"), (e, None))
        # float16 scales and offsets, as the kernels read them
        torch.testing.assert_close(fm.expert_weight(experts.w2.data, experts.scales(), "w2", e, 64, torch.float32),
                                   qt.dequantize(), atol=2e-3, rtol=2e-3)
    symmetric = _integer(8, 32, True)(w[2])  # no offsets, groups of 32: widened too
    experts.weight_loader(experts.w2, QuantRef(lambda: symmetric, "test"), (2, None))
    torch.testing.assert_close(fm.expert_weight(experts.w2.data, experts.scales(), "w2", 2, 64, torch.float32),
                               symmetric.dequantize(), atol=2e-3, rtol=2e-3)
    experts = MoEExperts(4, 32, 64, TPContext(), quant=QuantScheme(checkpoint="test"))
    experts.weight_loader(experts.w2, QuantRef(lambda: coarse, "test"), (0, None))
    with pytest.raises(ValueError, match="stored differently"):
        experts.weight_loader(experts.w2, QuantRef(lambda: fine, "test"), (1, None))
    for bad, why in ((_integer(4, 8, False)(w[0]), "groups of 8"),
                     (QuantizedTensor(coarse.codes, coarse.scales, coarse.biases, 4, 32,
                                      torch.arange(2, dtype=torch.int32).repeat_interleave(32)), "act-order")):
        experts = MoEExperts(4, 32, 64, TPContext(), quant=QuantScheme(checkpoint="test"))
        with pytest.raises(ValueError, match=why):
            experts.weight_loader(experts.w2, QuantRef(lambda bad=bad: bad, "test"), (0, None))


def test_moe_config_tiles_grow_with_tokens():
    sizes = [fm.moe_config(t, 8, 128).block_m for t in (1, 64, 300, 1024, 4096)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128


# -- GPU: real sizes, bf16, CUDA graphs -----------------------------------------------------------

QWEN3_30B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)  # per rank at TP=1


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 300, 1024, 4096])  # every moe_config tile size
def test_fused_moe_gpu_real_sizes(tokens):
    s = QWEN3_30B
    x, router, w13, w2 = _problem(tokens, s["top_k"], s["num_experts"], s["hidden"], s["inter"], seed=tokens,
                                  dead=7, dtype=torch.bfloat16, device="cuda")
    weights, ids = route(x @ router.T, s["top_k"], True)
    got = fm.fused_moe(x, w13, w2, weights, ids)
    want = fm.fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    _close(got, want, 1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])
def test_fused_moe_fp8_gpu_real_sizes(tokens, block):
    """Qwen3-30B-A3B's experts in FP8 (its checkpoint's 128 x 128 blocks, or in-situ per row),
    bf16 activations, against fp32 torch on the dequantized weights."""
    s = QWEN3_30B
    x, router, w13, w2 = _problem(tokens, s["top_k"], s["num_experts"], s["hidden"], s["inter"], seed=tokens,
                                  dead=7, dtype=torch.bfloat16, device="cuda")
    weights, ids = route(x @ router.T, s["top_k"], True)
    c13, c2, scales = _quantized_experts(w13.float(), w2.float(), _fp8(block), "cuda")
    got = fm.fused_moe(x, c13, c2, weights, ids, scales)
    _close(got, fm.fused_moe_torch(x.float(), *_dequantized(c13, c2, scales), weights, ids), 1.6e-2)


# Integer storage at real sizes: a Q4_K-like one (4 bits, groups of 32, offsets), a Q6_K-like one
# (8-bit containers, symmetric, groups of 16), in-situ int8 (a scale per row) and int4 (groups of 128)
REAL_INTEGER = {"q4_k": _integer(4, 32, False), "q6_k": _integer(8, 16, True),
                "int8": lambda m: quantize(m, "int8"), "int4": lambda m: quantize(m, "int4")}


@pytest.mark.gpu
@pytest.mark.parametrize("storage", list(REAL_INTEGER))
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])
def test_fused_moe_integer_gpu_real_sizes(tokens, storage):
    """Qwen3-30B-A3B's experts in integer codes, bf16 activations, against fp32 torch on the
    dequantized weights: the one-token kernels (1), the grouped GEMMs' tiles (4, 64, 1024)."""
    s = QWEN3_30B
    x, router, w13, w2 = _problem(tokens, s["top_k"], s["num_experts"], s["hidden"], s["inter"], seed=tokens,
                                  dead=7, dtype=torch.bfloat16, device="cuda")
    weights, ids = route(x @ router.T, s["top_k"], True)
    c13, c2, scales = _quantized_experts(w13.float(), w2.float(), REAL_INTEGER[storage], "cuda")
    assert c13.dtype == torch.uint8 and c13.shape[2] == s["hidden"] * scales.w13_bits // 8
    got = fm.fused_moe(x, c13, c2, weights, ids, scales)
    _close(got, fm.fused_moe_torch(x.float(), *_dequantized(c13, c2, scales), weights, ids), 1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", [None, "q4_k", "int8"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_fused_moe_in_cuda_graph(tokens, storage):
    """Captured once, replayed on new tokens and new routing: no host sync, no routing-dependent
    shape (a capture with either fails or replays stale work); 16-bit or integer experts, on the
    one-token kernels (1) and the grouped GEMMs (4)."""
    s = QWEN3_30B
    x, router, w13, w2 = _problem(tokens, s["top_k"], s["num_experts"], s["hidden"], s["inter"], seed=1, dead=7,
                                  dtype=torch.bfloat16, device="cuda")
    scales = fm.NO_SCALES
    if storage is not None:
        w13, w2, scales = _quantized_experts(w13.float(), w2.float(), REAL_INTEGER[storage], "cuda")
    ref13, ref2 = _dequantized(w13, w2, scales) if storage else (w13.float(), w2.float())

    def step():
        weights, ids = route(x @ router.T, s["top_k"], True)
        return fm.fused_moe(x, w13, w2, weights, ids, scales)

    step()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (2, 3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        x[:, 0] = 1.0  # the dead expert (NaN weights) stays unchosen
        graph.replay()
        weights, ids = route(x @ router.T, s["top_k"], True)  # as in the graph: the same near-ties
        _close(out, fm.fused_moe_torch(x.float(), ref13, ref2, weights, ids), 1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-moe", "mixtral"])
def test_moe_model_in_cuda_graphs_matches_transformers(tiny_models, arch):
    """A MoE model on the GPU decodes in CUDA graphs (fused experts: the decode steps replay a
    graph); greedy tokens as transformers' (fp32 everywhere, so no near-tie should flip; one is
    tolerated as elsewhere)."""
    from kvship.llm import LLM
    from kvship.sampling_params import SamplingParams

    folder, ref = tiny_models[arch]
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, num_kv_blocks=64)
    graphs = llm.engine.runner.graphs
    replays = []
    replay = graphs.run
    graphs.run = lambda *a, **kw: replays.append(1) or replay(*a, **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 319, (n,), generator=g).tolist() for n in (3, 9, 21, 40, 57)]
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    agree = 0
    for p, out in zip(prompts, got):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist()
        agree += out.outputs[0].token_ids == want
    assert agree >= len(prompts) - 1
    assert len(replays) >= 11, len(replays)  # 12 tokens each: every step after the prompts' is a decode
