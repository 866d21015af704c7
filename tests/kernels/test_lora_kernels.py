"""The LoRA shrink and expand kernels against their torch references (Triton's interpreter on a
CPU), on a batch mixing adapter slots, rows without one (-1) and ranks below the slots' width."""
import pytest
import torch

from kvship.kernels import lora
from kvship.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if not GPU else [torch.bfloat16])
@pytest.mark.timeout(120)
def test_shrink_and_expand_match_reference(dtype):
    g = torch.Generator().manual_seed(0)
    slots_n, rank, k, n = 3, 8, 96, 40
    x = torch.randn(7, k, generator=g).to(DEV, dtype)
    a = torch.randn(slots_n, 2 * rank, k, generator=g).to(DEV, dtype)  # two slices' A side by side
    b = torch.randn(slots_n, n, rank, generator=g).to(DEV, dtype)
    slots = torch.tensor([0, 0, -1, 2, 1, -1, 2], dtype=torch.int32, device=DEV)
    has = slots >= 0
    h_ref = lora.lora_shrink_torch(x, a, slots)
    h = lora.lora_shrink_triton(x, a, slots)
    torch.testing.assert_close(h[has], h_ref[has], rtol=1e-3, atol=1e-3)
    assert h_ref[~has].abs().sum() == 0
    # expand the second slice into columns 10.. of a wider output; rows without an adapter keep y
    y0 = torch.randn(7, 64, generator=g).to(DEV, dtype)
    y_ref, y = y0.clone(), y0.clone()
    lora.lora_expand_torch(y_ref, h_ref, b, slots, rank, 10)
    lora.lora_expand_triton(y, h_ref, b, slots, rank, 10)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    assert torch.equal(y[~has], y0[~has]) and torch.equal(y[:, :10], y0[:, :10])
    want = y0[0, 10:50].float() + (h_ref[0, rank:] @ b[0].float().T)
    torch.testing.assert_close(y[0, 10:50].float(), want, rtol=tol, atol=tol)
    assert not torch.allclose(y[has][:, 10:50].float(), y0[has][:, 10:50].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if not GPU else [torch.bfloat16])
@pytest.mark.timeout(300)
def test_segment_kernels_match_reference(dtype):
    """Prefill chunks: runs of rows of one adapter (longer than a block, and rows of none), the
    grouped kernels against the same torch references."""
    g = torch.Generator().manual_seed(1)
    rank, k, n = 8, 80, 48
    slot_list = [1] * 40 + [-1] * 5 + [0] * 7 + [1] + [-1, 2, 2]
    t = len(slot_list)
    slots = torch.tensor(slot_list, dtype=torch.int32, device=DEV)
    blocks_list = lora.segment_blocks(slot_list)
    assert [b[1] for b in blocks_list] == [32, 8, 7, 1, 2]
    blocks = torch.tensor(blocks_list, dtype=torch.int32, device=DEV).T.contiguous()
    x = torch.randn(t, k, generator=g).to(DEV, dtype)
    a = torch.randn(3, 2 * rank, k, generator=g).to(DEV, dtype)
    b = torch.randn(3, n, rank, generator=g).to(DEV, dtype)
    has = slots >= 0
    h_ref = lora.lora_shrink_torch(x, a, slots)
    h = lora.lora_shrink_segments(x, a, blocks)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h[has], h_ref[has], rtol=tol, atol=tol * 10)
    y0 = torch.randn(t, 60, generator=g).to(DEV, dtype)
    y_ref, y = y0.clone(), y0.clone()
    lora.lora_expand_torch(y_ref, h_ref, b, slots, rank, 12)
    lora.lora_expand_segments(y, h_ref, b, blocks, rank, 12)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * 10)
    assert torch.equal(y[~has], y0[~has])
