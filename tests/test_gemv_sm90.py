"""The one-row GEMV kernel (kernels/gemv.py) and the one-launch routing kernel
(kernels/moe_route.py) compile for sm_90 (H100/H200) in every variant the engine launches: plain,
with the gated activation, with the RMSNorm taken in (with and without a residual, keeping the
normalized input or not), at the launch settings of the listed shapes; on a machine without a
GPU (tests/sm90_compile.py says why)."""
from __future__ import annotations

import pytest

from kvship.kernels._triton import HAS_TRITON
from kvship.kernels.gemv import GEMV_SHAPES
from sm90_compile import compile_in_child, ints

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _specs():
    settings = {(cfg["block_n"], cfg["block_k"]): cfg for cfg in GEMV_SHAPES.values()}
    for (block_n, block_k), cfg in sorted(settings.items()):
        options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        for dtype in ("bf16", "fp32"):  # serving; --dtype float32
            types = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}",
                     "res_ptr": f"*{dtype}", "g_ptr": "*fp32" if dtype == "fp32" else "*bf16",
                     "res_out_ptr": f"*{dtype}", "normed_ptr": f"*{dtype}", "eps": "fp32",
                     **ints("N", "K", "stride_w")}
            for variant in (dict(), dict(GATED=True), dict(GATED=True, GELU=True), dict(NORM=True),
                            dict(NORM=True, RESIDUAL=True), dict(NORM=True, RESIDUAL=True, KEEP_NORMED=True,
                                                                HAS_BIAS=True)):
                flags = dict(HAS_BIAS=False, GATED=False, GELU=False, NORM=False, RESIDUAL=False, KEEP_NORMED=False)
                yield {"kernel": "kvship.kernels.gemv:_gemv_kernel", "types": types, "options": options,
                       "constexprs": {**flags, **variant, "BLOCK_N": block_n, "BLOCK_K": block_k}}
    router = GEMV_SHAPES[(128, 2048)]  # Qwen3-30B-A3B's router, top 8 of 128
    for residual in (True, False):
        types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "g_ptr": "*bf16", "w_ptr": "*bf16", "res_out_ptr": "*bf16",
                 "normed_ptr": "*bf16", "logits_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                 "count_ptr": "*i32", "eps": "fp32", **ints("num_experts", "K", "stride_w")}
        yield {"kernel": "kvship.kernels.moe_route:_norm_route_kernel", "types": types,
               "options": {"num_warps": router["num_warps"], "num_stages": router["num_stages"]},
               "constexprs": {"RESIDUAL": residual, "TOP_K": 8, "RENORMALIZE": True, "E_POW2": 128, "K_POW2": 8,
                              "BLOCK_N": router["block_n"], "BLOCK_K": router["block_k"]}}


@pytest.mark.timeout(600)
def test_gemv_and_routing_kernels_compile_for_sm90():
    compile_in_child(list(_specs()))
