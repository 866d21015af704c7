"""The paged attention kernels with a sliding window and a soft cap (Gemma 2's local layers, head
256), and with an attention chunk (Llama 4 Scout's rotary layers, head 128), compile for sm_90
(H100/H200) on a machine without a GPU (tests/sm90_compile.py says why), as does the GELU-tanh
gated activation. The quantized-cache variants are compiled by test_kv_quant.py."""
from __future__ import annotations

import pytest

from kvship.kernels._triton import HAS_TRITON
from sm90_compile import attention_types, compile_in_child, decode_types

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

MODULE = "kvship.kernels.paged_attention"


def _specs():
    # Gemma 2 9B's local layers (head 256, group 2, window 4096, cap 50): every code path the
    # options add; the other variants (a window alone, a cap alone, other heads) drop some of it
    options = dict(WINDOW=4096, SOFTCAP=50.0 * 1.4426950408889634)
    yield {"kernel": f"{MODULE}:_decode_kernel", "types": decode_types(),
           "constexprs": dict(GROUP=2, BLOCK_G=16, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16, BLOCK_N=64,
                              NUM_SPLITS=8, KV_MODE=0, **options)}
    yield {"kernel": f"{MODULE}:_prefill_kernel", "types": attention_types(),
           "constexprs": dict(GROUP=2, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, KV_MODE=0,
                              **options)}
    # Llama 4 Scout's chunked layers (head 128, group 5, chunks of 8192), the decode split or not
    for splits in (1, 8):
        yield {"kernel": f"{MODULE}:_decode_kernel", "types": decode_types(),
               "constexprs": dict(GROUP=5, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64,
                                  NUM_SPLITS=splits, KV_MODE=0, CHUNK=8192)}
    yield {"kernel": f"{MODULE}:_prefill_kernel", "types": attention_types(),
           "constexprs": dict(GROUP=5, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, KV_MODE=0,
                              CHUNK=8192)}
    yield {"kernel": "kvship.kernels.activation:_act_and_mul_kernel",
           "types": {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_out": "i32", "n_inter": "i32"},
           "constexprs": dict(BLOCK=1024, GELU=True)}


@pytest.mark.timeout(900)
def test_window_softcap_and_chunk_kernels_compile_for_sm90():
    compile_in_child(list(_specs()))
