"""The LoRA shrink and expand kernels against their torch references (Triton's interpreter on a
CPU): per row (the decode graphs' form, the shrink split over the input features, splits whose
width is no multiple of the tile, the gated activation applied as the shrink reads a gate/up
output) and per segment (prompt chunks), on rows mixing adapter slots, rows without one (-1),
and a fused projection's three parts; the per-row kernels also compiled for sm_90."""
import pytest
import torch

from kvship.kernels import lora, lora_segments
from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.activation import act_and_mul_torch
from sm90_compile import compile_in_child, ints

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.float16] if not GPU else [torch.bfloat16]
RANK, K, SLICES = 8, 200, [24, 16, 16]  # q, k, v of a fused projection


def _operands(slot_list, dtype, seed, k=K, x_width=None):
    g = torch.Generator().manual_seed(seed)
    t = len(slot_list)
    slots = torch.tensor(slot_list, dtype=torch.int32, device=DEV)
    x = torch.randn(t, x_width or k, generator=g).to(DEV, dtype)
    a = torch.randn(3, len(SLICES) * RANK, k, generator=g).to(DEV, dtype)
    b = torch.randn(3, sum(SLICES), RANK, generator=g).to(DEV, dtype)
    y0 = torch.randn(t, sum(SLICES), generator=g).to(DEV, dtype)
    return slots, x, a, b, y0


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("rows", [[0, 0, -1, 2, 1, -1, 2], [0]])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.timeout(300)
def test_per_row_kernels_match_reference(dtype, rows, monkeypatch):
    monkeypatch.setattr(lora, "MIN_SPLIT_K", 64)  # a split of the interpreter's small K
    slots, x, a, b, y0 = _operands(rows, dtype, 0)
    has = slots >= 0
    h_ref = lora.lora_shrink_torch(x, a, slots)
    h = lora.lora_shrink_triton(x, a, slots)
    assert h.shape[0] > 1 or len(rows) > 1  # one row: split over the input features
    tol = _tol(dtype)
    torch.testing.assert_close(h.sum(0)[has], h_ref[0, has], rtol=tol, atol=tol * 10)
    assert h_ref[0, ~has].abs().sum() == 0
    y_ref, y = y0.clone(), y0.clone()
    lora.lora_expand_torch(y_ref, h_ref, b, slots, SLICES)
    lora.lora_expand_triton(y, h, b, slots, SLICES)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)
    assert torch.equal(y[~has], y0[~has])
    # by hand: row 0 (slot 0), its k part (columns 24..40) from the k ranks (8..16)
    want = y0[0, 24:40].float() + h_ref[0, 0, RANK:2 * RANK] @ b[0, 24:40].float().T
    torch.testing.assert_close(y[0, 24:40].float(), want, rtol=tol, atol=tol * 10)
    # partial sums of three splits: the expand's tile of splits padded to four, the last masked
    h3 = torch.randn(3, *h.shape[1:], generator=torch.Generator().manual_seed(5)).to(DEV)
    y_ref, y = y0.clone(), y0.clone()
    lora.lora_expand_torch(y_ref, h3, b, slots, SLICES)
    lora.lora_expand_triton(y, h3, b, slots, SLICES)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("k, min_split_k, block_k", [(600, 128, 512), (600, 128, 128)])
@pytest.mark.timeout(300)
def test_shrink_splits_and_gated_input(k, min_split_k, block_k, act, monkeypatch):
    """Splits of 192 features read by a 256-wide tile (masked at the split's end) or by 128-wide
    tiles (two, the second half masked); the input a gate/up output, activated as it is read."""
    monkeypatch.setattr(lora, "MIN_SPLIT_K", min_split_k)
    monkeypatch.setattr(lora, "SHRINK_BLOCK_K", block_k)
    monkeypatch.setattr(lora, "device_sms", lambda x: 4)  # the split the interpreter gets, on a GPU too
    dtype = DTYPES[-1]
    slots, x, a, _, _ = _operands([2, -1, 0], dtype, 3, k=k, x_width=2 * k)
    has = slots >= 0
    h = lora.lora_shrink_triton(x[:1], a, slots[:1], act)
    assert h.shape[0] == 4  # 600 features in four splits of 192
    h_ref = lora.lora_shrink_torch(x, a, slots, act)
    want = act_and_mul_torch(x[:1], act).float() @ a[2].float().T  # by hand: row 0, slot 2
    tol = _tol(dtype)
    torch.testing.assert_close(h.sum(0)[0], want[0], rtol=tol, atol=tol * 10)
    torch.testing.assert_close(h_ref[0, :1], want, rtol=tol, atol=tol * 10)
    h = lora.lora_shrink_triton(x, a, slots, act)
    torch.testing.assert_close(h.sum(0)[has], h_ref[0, has], rtol=tol, atol=tol * 10)


def test_group_rows_blocks_any_grouping_fits():
    slot_list = [1] * 40 + [-1] * 5 + [0] * 7 + [1] + [-1, 2, 2]
    cap = lora_segments.num_blocks(len(slot_list), 3, 32)
    order, blocks = lora_segments.group_rows(slot_list, 32, cap)
    assert blocks.shape == (cap, 3)
    # slot 0's 7 rows, slot 1's 41 (40 + the one after slot 0's) in 32 + 9, slot 2's 2; the rest empty
    assert blocks[:4].tolist() == [[0, 7, 0], [7, 32, 1], [39, 9, 1], [48, 2, 2]] and not blocks[4:].any()
    assert order[:7].tolist() == list(range(45, 52)) and order[39:48].tolist() == list(range(32, 40)) + [52]
    assert len(order) == 50
    # the worst case: every adapter's rows one more than a block
    worst = [s for s in range(3) for _ in range(17)]
    _, blocks = lora_segments.group_rows(worst, 16, lora_segments.num_blocks(len(worst), 3, 16))
    assert (blocks[:, 1] > 0).sum() == 6


def _groups(slot_list, block_m):
    cap = lora_segments.num_blocks(len(slot_list), 3, block_m)
    order, blocks = lora_segments.group_rows(slot_list, block_m, cap)
    return lora_segments.RowGroups(torch.from_numpy(order).to(DEV), torch.from_numpy(blocks).to(DEV), block_m)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m, act", [(32, None), (16, "silu")])
@pytest.mark.timeout(300)
def test_grouped_kernels_match_reference(dtype, block_m, act, monkeypatch):
    """A prompt chunk's runs of one adapter (32 rows a block) and a decode batch's scattered
    rows (16 a block, the down projection's gated input); the shrink in splits, the expand's
    tile holding all three parts."""
    monkeypatch.setattr(lora_segments, "device_sms", lambda x: 8)  # a split of the small K
    monkeypatch.setattr(lora_segments, "GROUP_MIN_SPLIT_K", 64)
    slot_list = [1] * 40 + [-1] * 5 + [0] * 7 + [1] + [-1, 2, 2] if block_m == 32 else \
        [i % 4 - 1 for i in range(37)]
    slots, x, a, b, y0 = _operands(slot_list, dtype, 1, x_width=2 * K if act else K)
    groups = _groups(slot_list, block_m)
    has = slots >= 0
    h_ref = lora.lora_shrink_torch(x, a, slots, act)
    h = lora_segments.lora_shrink_grouped(x, a, groups, act)
    assert h.shape[0] > 1
    tol = _tol(dtype)
    torch.testing.assert_close(h.sum(0)[has], h_ref[0, has], rtol=tol, atol=tol * 10)
    y_ref, y = y0.clone(), y0.clone()
    lora.lora_expand_torch(y_ref, h_ref, b, slots, SLICES)
    lora_segments.lora_expand_grouped(y, h, b, groups, SLICES)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)
    assert torch.equal(y[~has], y0[~has])
    # wider parts: tiles of one part, of all three, of the last alone (partial); then a plain
    # projection's one part, its one tile partial
    g = torch.Generator().manual_seed(5)
    for parts, h_parts in [([160, 64, 64], h), ([100], h[:, :, :RANK].contiguous())]:
        b2 = torch.randn(3, sum(parts), RANK, generator=g).to(DEV, dtype)
        y_ref = torch.randn(len(slot_list), sum(parts), generator=g).to(DEV, dtype)
        y = y_ref.clone()
        lora.lora_expand_torch(y_ref, h_parts.sum(0, keepdim=True), b2, slots, parts)
        lora_segments.lora_expand_grouped(y, h_parts, b2, groups, parts)
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)


@pytest.mark.timeout(300)
def test_grouped_shrink_splits_a_long_input(monkeypatch):
    """However many programs a step has, none loops over more than GROUP_MAX_SPLIT_K features: a
    long input (the down projection's) is split all the same, and the sums still match."""
    monkeypatch.setattr(lora_segments, "GROUP_MAX_SPLIT_K", 64)
    monkeypatch.setattr(lora_segments, "MAX_GROUP_SPLIT", 1)
    slot_list = [i % 3 - 1 for i in range(20)]
    slots, x, a, b, _ = _operands(slot_list, DTYPES[0], 2)
    h = lora_segments.lora_shrink_grouped(x, a, _groups(slot_list, 16))
    assert h.shape[0] == -(-K // 64) > 1
    has = slots >= 0
    tol = _tol(DTYPES[0])
    torch.testing.assert_close(h.sum(0)[has], lora.lora_shrink_torch(x, a, slots)[0, has], rtol=tol, atol=tol * 10)


@pytest.mark.timeout(300)
def test_dispatch_takes_grouped_kernels_from_many_rows(monkeypatch):
    """lora_shrink / lora_expand with the rows grouped: the per-row kernels below
    GROUPED_MIN_ROWS rows, the grouped expand from there and the grouped shrink from
    GROUPED_SHRINK_MIN_ROWS; each gives the reference's result."""
    if not GPU:
        monkeypatch.setattr(lora, "use_triton", lambda t: True)
    called = []
    for name in ("lora_shrink_grouped", "lora_expand_grouped", "lora_shrink_triton", "lora_expand_triton"):
        fn = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *args, _fn=fn, _name=name, **kw: called.append(_name) or _fn(*args, **kw))
    dtype = DTYPES[-1]
    assert lora.GROUPED_SHRINK_MIN_ROWS > lora.GROUPED_MIN_ROWS
    for n in (lora.GROUPED_MIN_ROWS - 1, lora.GROUPED_MIN_ROWS, lora.GROUPED_SHRINK_MIN_ROWS):
        slot_list = [i % 4 - 1 for i in range(n)]
        slots, x, a, b, y0 = _operands(slot_list, dtype, 2)
        h = lora.lora_shrink(x, a, slots, _groups(slot_list, 16))
        y, y_ref = y0.clone(), y0.clone()
        lora.lora_expand(y, h, b, slots, SLICES, _groups(slot_list, 16))
        lora.lora_expand_torch(y_ref, lora.lora_shrink_torch(x, a, slots), b, slots, SLICES)
        tol = _tol(dtype)
        torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)
    assert called == ["lora_shrink_triton", "lora_expand_triton", "lora_shrink_triton", "lora_expand_grouped",
                      "lora_shrink_grouped", "lora_expand_grouped"]
    # an input longer than the grouped shrink's splits cover: per row up to LONG_INPUT_ROWS_FACTOR
    # times further (this test's rows kept few: the thresholds scaled down, its input made long)
    monkeypatch.setattr(lora, "GROUPED_SHRINK_MIN_ROWS", 8)
    monkeypatch.setattr(lora, "GROUP_MAX_SPLIT_K", K // (2 * lora.MAX_GROUP_SPLIT))
    long_from = lora.grouped_shrink_from(K)
    assert long_from == 8 * lora.LONG_INPUT_ROWS_FACTOR and lora.grouped_shrink_from(16) == 8
    called.clear()
    for n in (long_from - 1, long_from):
        slot_list = [i % 4 - 1 for i in range(n)]
        slots, x, a, b, _ = _operands(slot_list, dtype, 3)
        h = lora.lora_shrink(x, a, slots, _groups(slot_list, 16))
        has = slots >= 0
        torch.testing.assert_close(h.sum(0)[has], lora.lora_shrink_torch(x, a, slots)[0, has], rtol=_tol(dtype),
                                   atol=_tol(dtype) * 10)
    assert called == ["lora_shrink_triton", "lora_shrink_grouped"]


@pytest.mark.timeout(600)
def test_per_row_kernels_compile_for_sm90():
    """The per-row shrink and expand as the decode graphs launch them (the interpreter accepts
    programs the GPU compiler rejects): one to three parts, split counts that are and are not a
    power of two, the gated shrink; and the one-row GEMV with and without the shrink's rows."""
    shrink = {"x_ptr": "*bf16", "a_ptr": "*bf16", "slots_ptr": "*i32", "h_ptr": "*fp32",
              **ints("K", "R", "K_PER_SPLIT", "stride_x", "stride_as", "stride_ar", "stride_hs", "stride_h")}
    expand = {"h_ptr": "*fp32", "b_ptr": "*bf16", "slots_ptr": "*i32", "y_ptr": "*bf16",
              **ints("N", "RANK", "C1", "C2", "stride_hs", "stride_h", "stride_bs", "stride_bn", "stride_y")}
    specs = [{"kernel": "kvship.kernels.lora:_shrink_kernel", "types": shrink,
              "constexprs": {"GATED": gated, "GELU": False, "BLOCK_R": 16, "BLOCK_K": 512, "PDL": True},
              "options": {"num_warps": 4}} for gated in (False, True)]
    specs += [{"kernel": "kvship.kernels.lora:_expand_kernel", "types": expand,
               "constexprs": {"SPLIT": split, "BLOCK_S": block_s, "PARTS": parts, "BLOCK_N": 128, "BLOCK_R": 16,
                              "PDL": True}}
              for split, block_s in ((1, 1), (3, 4), (8, 8), (16, 16)) for parts in (1, 2, 3)]
    # the one-row GEMV taking the shrink as more programs (layers/lora.py at one token in a graph)
    gemv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "a_ptr": "*bf16",
            "slots_ptr": "*i32", "h_ptr": "*fp32", **ints("N", "K", "stride_w", "R", "stride_as", "stride_ar")}
    specs += [{"kernel": "kvship.kernels.gemv:_gemv_kernel", "types": gemv,
               "constexprs": {"HAS_BIAS": bias, "GATED": gated, "GELU": False, "BLOCK_N": 16, "BLOCK_K": 512,
                              "PDL": True, "LORA": lora}, "options": {"num_warps": 4, "num_stages": 3}}
              for bias, gated, lora in ((False, False, False), (True, False, True), (False, True, True))]
    compile_in_child(specs)
